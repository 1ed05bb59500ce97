"""Loading ``torch.distributed.checkpoint`` (DCP) checkpoints into an optimizer whose state is
kept in another format than the checkpoint's.

DCP loads into the tensors of a template state dict (``get_state_dict`` of the new optimizer):
each entry is read into the template's tensor of the same key, cast to its dtype. Across a change
of format that is wrong or impossible: 8-bit codes (``exp_avg_q8``) have no template entry in an
optimizer with BF16 moments (and BF16 moments none in an 8-bit one), a remainder none in an
optimizer with masters. :class:`LoadPlanner` lets DCP load what the checkpoint holds, so that
``set_state_dict`` hands it to the optimizer's ``load_state_dict``, which converts it as it
converts a ``torch.save`` checkpoint (docs/lean_state.md)::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import mpext.dcp

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, planner=mpext.dcp.LoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
"""
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["LoadPlanner"]

def format_entries() -> frozenset:
    """The per-param optimizer state entries whose form depends on the storage format: every
    key that mpext writes or reads (``mpext.optim._state.known_keys``, from the formats
    table: every moment format's keys, the param formats' storage keys, the EMA, and the
    scale keys of codes saved before codes had keys of their own) for every quantity of every
    rule, i.e. of every ``FusedOptimizer`` subclass defined so far (a rule added later, or a
    user's, is included without a list to edit here). ``step`` and the entries of other
    optimizers load as DCP loads them."""
    from ..optim._base import FusedOptimizer
    from ..optim._state import known_keys

    keys, todo = set(), [FusedOptimizer]
    while todo:
        cls = todo.pop()
        keys.update(known_keys(cls.moments))
        todo.extend(cls.__subclasses__())
    keys.discard("step")  # a scalar tensor of one form in every format
    return frozenset(keys)


class LoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that, for every param whose optimizer state in the template has
    other format entries than the checkpoint's (other names, dtypes or shapes), replaces the
    template's entries with empty tensors shaped as the checkpoint's, so that DCP loads the
    checkpoint's state as saved. Full tensors are loaded for sharded params (the optimizer's
    ``load_state_dict`` keeps each rank's shard). Everything else loads as with
    ``DefaultLoadPlanner``."""

    def set_up_planner(self, state_dict: Dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        if metadata is not None:
            _fit_to_checkpoint(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _fit_to_checkpoint(state_dict: Dict[str, Any], metadata: Metadata) -> None:
    """Rewrites, in place, the format entries of every param state of ``state_dict`` (a dict
    ``...["state"][fqn]``) that differ from the checkpoint's."""
    entries = format_entries()
    _, mappings = flatten_state_dict(state_dict)
    params: Dict[str, Tuple[tuple, Dict[str, Any]]] = {}
    for key, path in mappings.items():
        name = path[-1]
        if len(path) >= 3 and path[-3] == "state" and name in entries:
            prefix = key[:-len(str(name)) - 1]
            if prefix not in params:
                params[prefix] = (path[:-1], {})
            params[prefix][1][name] = _element(state_dict, path)
    saved = metadata.state_dict_metadata
    for prefix, (parent_path, mine) in params.items():
        theirs = {}
        for key, md in saved.items():
            rest = key[len(prefix) + 1:]
            if key.startswith(prefix + ".") and rest in entries \
                    and isinstance(md, TensorStorageMetadata):
                theirs[rest] = md
        if not theirs or _same_form(mine, theirs):
            continue
        parent = _element(state_dict, parent_path)
        device = next(_device_of(t) for t in mine.values() if isinstance(t, torch.Tensor))
        for name in mine:
            del parent[name]
        for name, md in theirs.items():
            parent[name] = torch.empty(md.size, dtype=md.properties.dtype, device=device)


def _same_form(mine: Dict[str, Any], theirs: Dict[str, TensorStorageMetadata]) -> bool:
    if mine.keys() != theirs.keys():
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == theirs[k].properties.dtype
               and tuple(t.shape) == tuple(theirs[k].size) for k, t in mine.items())


def _device_of(t: torch.Tensor) -> torch.device:
    return t.to_local().device if hasattr(t, "to_local") else t.device


def _element(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj
