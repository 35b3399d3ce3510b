"""A model's share of the pipeline: which decoder layers this stage builds (placeholders stand in for the others, so
its own layers keep their indices and checkpoint names), and which checkpoint tensors another stage holds.

Under pipeline parallelism (the PP group) each stage builds and loads only its range of decoder layers: the first
also the embedding, the last the final norm and the LM head (and the embedding, when the head is tied to it). With
one stage every layer is built here.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagellm.distributed.parallel_state import get_pp_group, stage_layer_range


class PPMissingLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds: no parameters."""


class StageLayers:
    """The decoder layers of a model on this stage: `layers` has one entry per layer of the model (placeholders for
    other stages'), `own` this stage's layers in order, `start`/`end` their index range."""

    def __init__(self, num_layers: int, build: Callable[[int], nn.Module]) -> None:
        pp = get_pp_group()
        self.start, self.end = stage_layer_range(num_layers, pp.rank, pp.world_size)
        self.layers = nn.ModuleList(build(index) if self.start <= index < self.end else PPMissingLayer()
                                    for index in range(num_layers))
        self.own: list[nn.Module] = list(self.layers)[self.start:self.end]

    def holds_layer(self, index: int) -> bool:
        return self.start <= index < self.end


def held_elsewhere(name: str, stage: StageLayers, absent_modules: set[str]) -> bool:
    """Whether checkpoint tensor `name` (without "model.") belongs to a module this stage does not build: a decoder
    layer of another stage, or one of `absent_modules` (top-level modules this stage lacks, such as the LM head)."""
    module = name.split(".", 1)[0]
    if module == "layers":
        return not stage.holds_layer(int(name.split(".")[1]))
    return module in absent_modules

