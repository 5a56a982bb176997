// The anatomy page's explorers: interactive views over numbers the report embedded (each
// div.explorer[data-kind] holds its data as JSON in a child script element). Plain
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

  // the text's tokens as a row of spans (data-t = position); `event` on one calls pick(t)
  function tokenStrip(parent, cls, labels, event, pick) {
    const strip = el("div", {class: cls}, parent);
    return labels.map((label, t) => {
      const span = el("span", {text: label, "data-t": t, style: "cursor:pointer; padding:0 2px; " +
                               "margin:1px; display:inline-block"}, strip);
      span.addEventListener(event, () => pick(t));
      return span;
    });
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


  // ---- RoPE: a real query's frequency pairs rotating with position -------------------------------
  // RoFormer (Su et al. 2021) eq. 14: pair i of a query at position m is turned by m·θ_i; the
  // pairs are dims (2i, 2i+1) (Meta's layout, which the loader gives every checkpoint). The
  // score q_m·k_n sums every pair's rotated dot product (and the dims past the rotated ones,
  // unturned): it depends on m − n only (eq. 16), shown by q_{m+s}·k_{n+s}.
  function ropeScore(q, k, theta, m, n) {
    let s = 0;
    const P = theta.length;
    for (let i = 0; i < P; i++) {
      const a = m * theta[i], b = n * theta[i];
      const qx = q[2 * i] * Math.cos(a) - q[2 * i + 1] * Math.sin(a);
      const qy = q[2 * i] * Math.sin(a) + q[2 * i + 1] * Math.cos(a);
      const kx = k[2 * i] * Math.cos(b) - k[2 * i + 1] * Math.sin(b);
      const ky = k[2 * i] * Math.sin(b) + k[2 * i + 1] * Math.cos(b);
      s += qx * kx + qy * ky;
    }
    for (let d = 2 * P; d < q.length; d++) s += q[d] * k[d];
    return s;
  }

  function ropeExplorer(root, data) {
    const q = floats(data.q), k = floats(data.k), theta = floats(data.theta);
    const P = theta.length, ctx = data.context;
    const stack = data.stack;                          // the pairs drawn, spread over the spectrum
    const radius = stack.map(i => Math.hypot(q[2 * i], q[2 * i + 1]));
    const rmax = Math.max(...radius, 1e-12);
    el("div", {text: `Layer-0 query of “${data.token}” (head ${data.head}), ${P} frequency ` +
               `pairs of θ_i = ${data.base_words}; drag the view to turn it.`}, root);
    const controls = el("div", {}, root);
    const view = canvas(root, 760, 420);
    const out = el("div", {class: "readout rope-readout"}, root);
    const state = {m: 0, i: data.pair, n: 0, s: data.shift, yaw: 0.6, pitch: 1.0, playing: false};

    function project(x, y, z) {                        // yaw about z, then pitch about x
      const cy = Math.cos(state.yaw), sy = Math.sin(state.yaw);
      const x1 = x * cy - y * sy, y1 = x * sy + y * cy;
      const cp = Math.cos(state.pitch), sp = Math.sin(state.pitch);
      const y2 = y1 * cp - z * sp;
      const W = view.c.width, H = view.c.height, scale = H / 3.2;
      return [W / 2 + scale * x1, H / 2 + scale * y2];
    }
    function draw() {
      const g = view.g, L = stack.length;
      g.clearRect(0, 0, view.c.width, view.c.height);
      g.font = "11px system-ui, sans-serif";
      stack.forEach((pair, level) => {
        const z = (level - (L - 1) / 2) * (2.2 / Math.max(L - 1, 1));
        const r = radius[level] / rmax;
        const selected = pair === state.i;
        g.strokeStyle = selected ? "#d04a4a" : "#ccd";
        g.beginPath();
        for (let t = 0; t <= 64; t++) {
          const a = 2 * Math.PI * t / 64;
          const [px, py] = project(r * Math.cos(a), r * Math.sin(a), z);
          t ? g.lineTo(px, py) : g.moveTo(px, py);
        }
        g.stroke();
        const phase = Math.atan2(q[2 * pair + 1], q[2 * pair]);
        g.strokeStyle = selected ? "rgba(208,74,74,0.35)" : "rgba(74,123,208,0.25)";
        g.beginPath();                                 // the last 24 positions' trail
        for (let t = Math.max(0, state.m - 24); t <= state.m; t++) {
          const a = phase + t * theta[pair];
          const [px, py] = project(r * Math.cos(a), r * Math.sin(a), z);
          t === Math.max(0, state.m - 24) ? g.moveTo(px, py) : g.lineTo(px, py);
        }
        g.stroke();
        const a = phase + state.m * theta[pair];
        const [cx, cy] = project(0, 0, z), [px, py] = project(r * Math.cos(a), r * Math.sin(a), z);
        g.strokeStyle = selected ? "#d04a4a" : "#4a7bd0";
        g.lineWidth = 2;
        g.beginPath(); g.moveTo(cx, cy); g.lineTo(px, py); g.stroke();
        g.lineWidth = 1;
        g.fillStyle = "#444";
        g.fillText(`pair ${pair}: λ = ${fmt(2 * Math.PI / theta[pair], 3)}`, px + 4, py);
      });
      const th = theta[state.i], angle = state.m * th;
      const score = ropeScore(q, k, theta, state.m, state.n);
      const shifted = ropeScore(q, k, theta, state.m + state.s, state.n + state.s);
      Object.assign(out.dataset, {m: state.m, pair: state.i, n: state.n, shift: state.s,
                                  angle: String(angle), wavelength: String(2 * Math.PI / th),
                                  score: String(score), shifted: String(shifted)});
      out.textContent = `m = ${state.m}${state.m > ctx ? " (past the trained context " + ctx + ")" : ""}; ` +
        `pair ${state.i}: m·θ = ${fmt(angle, 6)} rad (${fmt(angle % (2 * Math.PI), 4)} mod 2π), ` +
        `wavelength 2π/θ = ${fmt(2 * Math.PI / th, 5)} positions. ` +
        `q_m·k_n = ${fmt(score, 6)} for n = ${state.n}; q_(m+${state.s})·k_(n+${state.s}) = ` +
        `${fmt(shifted, 6)}: the same, the score depends on m − n only.`;
    }
    const mSlider = slider(controls, "position m", 0, 2 * ctx, 1, 0, v => { state.m = v; draw(); });
    slider(controls, "pair i", 0, P - 1, 1, state.i, v => { state.i = v; draw(); });
    slider(controls, "key position n", 0, ctx, 1, 0, v => { state.n = v; draw(); });
    slider(controls, "shift s", 0, ctx, 1, state.s, v => { state.s = v; draw(); });
    const play = el("button", {type: "button", text: "▶ play"}, controls);
    function step() {
      if (!state.playing) return;
      mSlider.input.value = String((state.m + 1) % (2 * ctx + 1));
      mSlider.update();
      requestAnimationFrame(step);
    }
    play.addEventListener("click", () => {
      state.playing = !state.playing;
      play.textContent = state.playing ? "❚❚ pause" : "▶ play";
      if (state.playing) requestAnimationFrame(step);
    });
    let drag = null;
    view.c.addEventListener("pointerdown", e => { drag = [e.clientX, e.clientY]; });
    window.addEventListener("pointerup", () => { drag = null; });
    view.c.addEventListener("pointermove", e => {
      if (!drag) return;
      state.yaw += (e.clientX - drag[0]) / 150;
      state.pitch = Math.min(Math.PI, Math.max(0, state.pitch + (e.clientY - drag[1]) / 150));
      drag = [e.clientX, e.clientY];
      draw();
    });
    draw();
  }


  // ---- attention: every layer's and head's probabilities over the page's first tokens ------------
  // probs (L, H, T, T): row t of head h in layer l is query t's softmax over keys 0..t (causal).
  function colorScale(v) {                             // 0 → white, 1 → dark blue
    const x = Math.max(0, Math.min(1, v));
    return `rgb(${Math.round(255 - 221 * x)},${Math.round(255 - 181 * x)},${Math.round(255 - 75 * x)})`;
  }

  function attentionExplorer(root, data) {
    const probs = floats(data.probs);
    const [L, H, T] = data.probs.shape;
    const labels = data.labels, roles = Object.keys(data.scores);
    const state = {layer: data.layer, head: 0, row: T - 1, role: roles[0]};
    const controls = el("div", {}, root);
    const layerSel = el("select", {"data-name": "layer"}, el("label", {text: "layer "}, controls));
    for (let l = 0; l < L; l++) el("option", {value: l, text: l}, layerSel);
    const headSel = el("select", {"data-name": "head"}, el("label", {text: "head "}, controls));
    for (let h = 0; h < H; h++) el("option", {value: h, text: h}, headSel);
    const roleSel = el("select", {"data-name": "grid score"},
                       el("label", {text: "grid coloured by "}, controls));
    for (const r of roles) el("option", {value: r, text: r}, roleSel);
    const row = el("div", {style: "display:flex; gap:1em; align-items:flex-start"}, root);
    const cell = Math.max(8, Math.min(22, Math.floor(300 / Math.max(L, H))));
    const grid = canvas(row, H * cell + 40, L * cell + 20);
    grid.c.classList.add("attention-grid");
    const side = Math.max(4, Math.floor(420 / T));
    const heat = canvas(row, T * side + 2, T * side + 2);
    heat.c.classList.add("attention-heatmap");
    const out = el("div", {class: "readout attention-readout"}, root);
    const tokens = tokenStrip(root, "attention-tokens", labels, "mouseenter",
                              t => { state.row = t; draw(); });
    const weights = el("div", {class: "readout attention-row"}, root);
    const at = (l, h, t, s) => probs[((l * H + h) * T + t) * T + s];

    function draw() {
      layerSel.value = String(state.layer);
      headSel.value = String(state.head);
      const score = data.scores[state.role];
      let g = grid.g;
      g.clearRect(0, 0, grid.c.width, grid.c.height);
      g.font = "9px system-ui, sans-serif";
      const values = score.flat(), lo = Math.min(...values), hi = Math.max(...values);
      for (let l = 0; l < L; l++) {
        g.fillStyle = "#666";
        g.fillText(String(l), 2, 20 + l * cell + cell * 0.7);
        for (let h = 0; h < H; h++) {
          g.fillStyle = colorScale((score[l][h] - lo) / (hi - lo || 1));
          g.fillRect(30 + h * cell, 20 + l * cell, cell - 1, cell - 1);
        }
      }
      for (let h = 0; h < H; h++) { g.fillStyle = "#666"; g.fillText(String(h), 30 + h * cell + 2, 12); }
      g.strokeStyle = "#d04a4a";
      g.lineWidth = 2;
      g.strokeRect(30 + state.head * cell, 20 + state.layer * cell, cell - 1, cell - 1);
      g.lineWidth = 1;
      g = heat.g;
      g.clearRect(0, 0, heat.c.width, heat.c.height);
      for (let t = 0; t < T; t++)
        for (let s = 0; s <= t; s++) {
          g.fillStyle = colorScale(at(state.layer, state.head, t, s));
          g.fillRect(1 + s * side, 1 + t * side, side, side);
        }
      g.strokeStyle = "#d04a4a";
      g.strokeRect(0.5, 0.5 + state.row * side, T * side + 1, side + 1);
      const role = roles.map(r => `${r} ${fmt(data.scores[r][state.layer][state.head], 3)}`);
      Object.assign(out.dataset, {layer: state.layer, head: state.head, row: state.row});
      out.textContent = `layer ${state.layer}, head ${state.head} (${data.categories[state.layer][state.head]}): ` +
        role.join(", ") + ". Hover a token below for its row.";
      tokens.forEach((span, t) => { span.style.background = t === state.row ? "#fde2e2" : ""; });
      weights.replaceChildren();
      el("span", {text: `“${labels[state.row]}” (query ${state.row}) attends to: `}, weights);
      for (let s = 0; s <= state.row; s++) {
        const p = at(state.layer, state.head, state.row, s);
        el("span", {text: `${labels[s]} ${fmt(p, 3)}`, "data-s": s, "data-p": String(p),
                    style: `background:${colorScale(p)}; margin:1px; padding:0 2px; display:inline-block`}, weights);
      }
    }
    layerSel.addEventListener("change", () => { state.layer = Number(layerSel.value); draw(); });
    headSel.addEventListener("change", () => { state.head = Number(headSel.value); draw(); });
    roleSel.addEventListener("change", () => { state.role = roleSel.value; draw(); });
    grid.c.addEventListener("click", e => {
      const r = grid.c.getBoundingClientRect(), k = grid.c.width / r.width;   // CSS scaling
      const h = Math.floor(((e.clientX - r.left) * k - 30) / cell);
      const l = Math.floor(((e.clientY - r.top) * k - 20) / cell);
      if (h >= 0 && h < H && l >= 0 && l < L) { state.layer = l; state.head = h; draw(); }
    });
    draw();
  }

  // ---- logit lens: the top next tokens after every block, at a position you click -----------------
  // ids / probs (L, T, k): softmax(output(norm(h_l))) after block l at position t, best first.
  function lensExplorer(root, data) {
    const probs = floats(data.probs);
    const [L, T, K] = data.probs.shape;
    const ids = data.ids, words = data.words, labels = data.labels;
    const state = {t: Math.min(T - 1, data.position), block: L - 1};
    const spans = tokenStrip(root, "lens-tokens", labels, "click", t => { state.t = t; draw(); });
    const controls = el("div", {}, root);
    slider(controls, "block", 0, L - 1, 1, L - 1, v => { state.block = v; draw(); });
    const out = el("div", {class: "readout lens-readout"}, root);
    const table = el("table", {class: "lens-table"}, root);
    function draw() {
      spans.forEach((span, t) => { span.style.background = t === state.t ? "#fde2e2" : ""; });
      Object.assign(out.dataset, {t: state.t, block: state.block});
      const top = [0, 1, 2].map(j => `${words[ids[state.block][state.t][j]]} ` +
        fmt(probs[(state.block * T + state.t) * K + j], 3));
      out.textContent = `After “${labels[state.t]}” (position ${state.t}), block ${state.block}` +
        ` predicts: ${top.join(", ")}` + (state.block === L - 1 ? " (the model's output)" : "");
      table.replaceChildren();
      const head = el("tr", {}, table);
      el("th", {text: "block"}, head);
      for (let j = 0; j < K; j++) el("th", {text: `#${j + 1}`}, head);
      for (let l = 0; l < L; l++) {
        const tr = el("tr", {"data-block": l, style: l === state.block ? "outline: 2px solid #d04a4a" : ""}, table);
        el("td", {text: l}, tr);
        for (let j = 0; j < K; j++) {
          const p = probs[(l * T + state.t) * K + j], id = ids[l][state.t][j];
          el("td", {text: `${words[id]} ${fmt(p, 2)}`, "data-id": id, "data-p": String(p),
                    style: `background:${colorScale(p)}; text-align:left`}, tr);
        }
      }
    }
    draw();
  }

  const KINDS = {sampling: samplingExplorer, rope: ropeExplorer, attention: attentionExplorer,
                 lens: lensExplorer};

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
