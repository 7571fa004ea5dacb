"""Forward hooks shared by every system that reads or changes a model's layers from outside.

Memories on a Hugging Face model (training/hf.py), memory adapters on one
(training/finetune/hf_adapters.py), the context bank's reader (training/context/vae.py) and the
evaluations that count routing decisions all hook layers they do not own. Two rules hold for
all of them, so they live here once:
- a hook that must follow its owner through `copy.deepcopy` or pickling is an object holding
  the owner (`LayerHook`), not a closure, which would keep pointing at the original;
- a hook installed for one call is removed when the call ends, even on error (`attached`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn


class LayerHook:
    """A hook of one decoder layer on behalf of its owner (the wrapping model): objects rather
    than closures so that `copy.deepcopy` / pickling of the owner re-points them at the copy (a
    closure would keep the original)."""

    def __init__(self, owner: nn.Module, layer: int) -> None:
        self.owner, self.layer = owner, layer


def first_tensor(args: tuple, kwargs: dict) -> Tensor:
    """The module's input tensor from a hook's (args, kwargs): HF layers take it positionally or
    as hidden_states / x / input."""
    if args:
        return args[0]
    for key in ("hidden_states", "x", "input"):
        if key in kwargs:
            return kwargs[key]
    raise RuntimeError("memory hook: cannot find the module's input tensor")


@contextmanager
def attached(
    hooks: Iterable[tuple[nn.Module, Callable]], *, pre: bool = False, with_kwargs: bool = False
) -> Iterator[None]:
    """Register each (module, hook) as a forward hook (pre=True: a forward pre-hook) for the
    duration of the block; all of them are removed on exit, even on error."""
    handles = []
    try:
        for module, fn in hooks:
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            handles.append(register(fn, with_kwargs=with_kwargs))
        yield
    finally:
        for h in handles:
            h.remove()
