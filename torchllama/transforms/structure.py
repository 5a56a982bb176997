"""How many times a module's structure changed anywhere in this process: a submodule, parameter
or buffer assigned or registered on any `nn.Module` (torch's global registration hooks count
them, `torch.nn.modules.module.register_module_*_registration_hook`).

What a module tree holds can then be remembered with the count it was read at and trusted
while the count is the same: `fuse.FusedTransformerBlock.weights` and
`fuse.StackedExperts.serves` are asked every forward, and walking the modules each time
(64 experts' modules a layer in an OLMoE-shaped model, read with the caches cold as they are
between a step's weight streams) was a visible share of a decode step (`torchllama bench decode`
on the OLMoE shape).

Not counted: deleting an attribute (`del module.sub`) and editing `_modules`, `_parameters` or
`_buffers` by hand; a module changed so is not noticed.
"""

from torch.nn.modules import module as _module

_changes = 0


def _count(*_) -> None:
    global _changes
    _changes += 1


_module.register_module_module_registration_hook(_count)
_module.register_module_parameter_registration_hook(_count)
_module.register_module_buffer_registration_hook(_count)


def version() -> int:
    """The number of module, parameter and buffer registrations so far in this process."""
    return _changes
