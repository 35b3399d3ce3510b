"""The worker's adapters: loaded from their directory on a request's first step, kept by `lora_int_id` (the
`max_loras` most recently used; the step's own adapters are never evicted), and each step's token rows grouped
per adapter for the linear layers (see context.py)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagellm.config import LoRAConfig
from pagellm.lora.context import LoRABatch, LoRAGroup
from pagellm.lora.peft import load_peft_adapter
from pagellm.lora.request import LoRARequest
from pagellm.lora.weights import LoRAModel, build_lora_model


class LoRAWorkerManager:
    def __init__(self, config: LoRAConfig, model: nn.Module, hf_config, device: torch.device) -> None:
        self.config, self.model, self.hf_config, self.device = config, model, hf_config, device
        self.adapters: OrderedDict[int, LoRAModel] = OrderedDict()

    def _get(self, request: LoRARequest) -> LoRAModel:
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            peft = load_peft_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
            adapter = self.adapters[request.lora_int_id] = build_lora_model(request.lora_int_id, peft, self.model,
                                                                            self.device)
        self.adapters.move_to_end(request.lora_int_id)
        return adapter

    def batch(self, requests: list[LoRARequest | None], query_lens: np.ndarray) -> LoRABatch | None:
        """The rows of each adapter in a step whose sequences (in the flat batch's order, `query_lens` tokens each)
        run with `requests`; None when none has an adapter."""
        if all(r is None for r in requests):
            return None
        ids = np.array([0 if r is None else r.lora_int_id for r in requests], dtype=np.int64)
        token_ids = np.repeat(ids, query_lens)
        groups = []
        for request in {r.lora_int_id: r for r in requests if r is not None}.values():
            rows = np.flatnonzero(token_ids == request.lora_int_id)
            index: slice | torch.Tensor | None
            if len(rows) == len(token_ids):
                index = None
            elif rows[-1] - rows[0] + 1 == len(rows):
                index = slice(int(rows[0]), int(rows[-1]) + 1)
            else:
                index = torch.from_numpy(rows).to(self.device, non_blocking=True)
            groups.append(LoRAGroup(self._get(request), index))
        for lora_id in list(self.adapters)[:max(0, len(self.adapters) - max(self.config.max_loras, len(groups)))]:
            del self.adapters[lora_id]  # least recently used first; this step's adapters are the most recent
        return LoRABatch(groups)
