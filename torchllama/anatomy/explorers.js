// The anatomy page's explorers: interactive views over numbers the report embedded (each
// <div class="explorer" data-kind="…"> holds its data as JSON in a <script> child). Plain
// JavaScript and <canvas>, written for this page: no library, no network.
//
// Each explorer keeps what it shows in data-* attributes of its elements (the tests read them
// back: tests/test_anatomy_explorers.py) and recomputes from the embedded numbers on every input.
"use strict";
(function () {
  // ---- shared helpers --------------------------------------------------------------------------
  // {"f32": base64 little-endian float32, "shape": [...]} → Float32Array (report.float32_blob)
  function floats(blob) {
    const bin = atob(blob.f32);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Float32Array(bytes.buffer);
  }

  function el(tag, attrs, parent) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    if (parent) parent.appendChild(e);
    return e;
  }

  // a labelled <input type="range">; onInput(value) on every move
  function slider(parent, label, min, max, step, value, onInput) {
    const wrap = el("label", {}, parent);
    wrap.append(label + " ");
    const input = el("input", {type: "range", min, max, step, value, "data-name": label}, wrap);
    const shown = el("span", {class: "readout"}, wrap);
    const update = () => { shown.textContent = " " + input.value; onInput(Number(input.value)); };
    input.addEventListener("input", update);
    return {input, update};
  }

  function canvas(parent, width, height) {
    const c = el("canvas", {width, height}, parent);
    return {c, g: c.getContext("2d")};
  }

  function fmt(x, digits) { return Number(x).toPrecision(digits || 4); }

  // ---- sampling: temperature, top-p, min-p over the real next-token logits -----------------------
  // The sampler's rules (torchllama.generation.sampling.process_logits): p = softmax(l / T); top-p
  // (Meta's rule) drops a token when the mass before it, sorted descending, exceeds top_p; min-p
  // drops p_j < min_p · p_max. Both keep a prefix of the tokens sorted by logit (the order does
  // not change with T), so the kept set is the shorter prefix.
  function keptSet(logits, order, T, topP, minP) {
    const V = order.length, z = logits[order[0]] / T;
    const p = new Float64Array(V);
    let sum = 0;
    for (let r = 0; r < V; r++) { p[r] = Math.exp(logits[order[r]] / T - z); sum += p[r]; }
    for (let r = 0; r < V; r++) p[r] /= sum;
    let nTopP = V;
    if (topP < 1) {
      let before = 0;
      for (let r = 0; r < V; r++) {
        if (r > 0 && before > topP) { nTopP = r; break; }
        before += p[r];
      }
    }
    let nMinP = V;
    if (minP > 0) {
      for (let r = 1; r < V; r++) if (p[r] < minP * p[0]) { nMinP = r; break; }
    }
    const kept = Math.min(nTopP, nMinP);
    let mass = 0;
    for (let r = 0; r < kept; r++) mass += p[r];
    return {p, nTopP, nMinP, kept, mass};
  }

  function samplingExplorer(root, data) {
    const logits = floats(data.logits);
    const order = Array.from(logits.keys()).sort((a, b) => logits[b] - logits[a] || a - b);
    const labels = data.top_labels, N = labels.length;
    el("div", {text: `Next token after “${data.prompt}” (${logits.length.toLocaleString()} ` +
               "logits of the model, recomputed here on every move)"}, root);
    const controls = el("div", {}, root);
    const view = canvas(root, 760, 22 * N + 30);
    const out = el("div", {class: "readout sampling-kept"}, root);
    const state = {T: data.defaults.temperature, topP: data.defaults.top_p,
                   minP: data.defaults.min_p};
    function draw() {
      const s = keptSet(logits, order, state.T, state.topP, state.minP);
      const g = view.g, W = view.c.width, left = 150;
      g.clearRect(0, 0, W, view.c.height);
      g.font = "12px system-ui, sans-serif";
      for (let r = 0; r < N; r++) {
        const y = 10 + 22 * r, w = (W - left - 90) * s.p[r];
        g.fillStyle = r < s.kept ? "#4a7bd0" : "#bbb";
        g.fillRect(left, y, Math.max(w, 1), 16);
        g.fillStyle = "#222";
        g.textAlign = "right";
        g.fillText(labels[r], left - 6, y + 12);
        g.textAlign = "left";
        g.fillText(fmt(s.p[r], 3), left + w + 4, y + 12);
      }
      out.dataset.kept = String(s.kept);
      out.dataset.topP = String(s.nTopP);
      out.dataset.minP = String(s.nMinP);
      out.textContent = `T = ${state.T}, top-p = ${state.topP}, min-p = ${state.minP}: the ` +
        `sampler keeps ${s.kept.toLocaleString()} tokens (mass ${fmt(s.mass, 4)} before ` +
        `renormalizing; top-p alone keeps ${s.nTopP.toLocaleString()}, min-p alone ` +
        `${s.nMinP.toLocaleString()}). Blue: kept; grey: cut (of the ${N} most likely).`;
    }
    slider(controls, "temperature", 0.05, 2.5, 0.05, state.T, v => { state.T = v; draw(); });
    slider(controls, "top-p", 0.05, 1, 0.01, state.topP, v => { state.topP = v; draw(); });
    slider(controls, "min-p", 0, 0.5, 0.01, state.minP, v => { state.minP = v; draw(); });
    draw();
  }

  const KINDS = {sampling: samplingExplorer};

  function start() {
    for (const root of document.querySelectorAll("div.explorer")) {
      const source = root.querySelector("script[type='application/json']");
      const make = KINDS[root.dataset.kind];
      if (!make) throw new Error(`explorer ${root.id}: unknown kind ${root.dataset.kind}`);
      make(root, JSON.parse(source.textContent));
      root.dataset.ready = "1";
    }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
