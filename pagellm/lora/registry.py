"""The engine's adapters: the named ones the server serves (--lora-modules at start, then
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`), and the check every request's adapter passes before it is
queued (its directory read and checked against the base model once per adapter id)."""
from __future__ import annotations

import itertools
import threading

from pagellm.config import LoRAConfig, ModelConfig
from pagellm.lora.peft import load_peft_adapter
from pagellm.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig, model_config: ModelConfig) -> None:
        self.config, self.model_config = config, model_config
        self._named: dict[str, LoRARequest] = {}
        self._checked: dict[int, str] = {}  # lora_int_id -> the path checked under that id
        self._next_id = itertools.count(1)
        self._lock = threading.RLock()  # the server's handlers and the engine's input thread both call in
        for module in config.lora_modules:
            name, _, path = module.partition("=")
            self.load(name, path)

    def check(self, request: LoRARequest) -> None:
        """Raise ValueError naming what is wrong with `request`'s adapter for this base model."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}.")
        checked = self._checked.get(request.lora_int_id)
        if checked == request.lora_path:
            return
        if checked is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} already names the adapter at {checked}; give "
                             f"{request.lora_path} another id.")
        load_peft_adapter(request.lora_path, self.model_config.hf_config, self.config.max_lora_rank)
        with self._lock:
            self._checked[request.lora_int_id] = request.lora_path

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as model `name`."""
        if not name or not path:
            raise ValueError(f"A LoRA adapter needs a name and a path (name=path), got {name!r} and {path!r}.")
        if name in self._named or name == self.model_config.served_model_name:
            raise ValueError(f"The name {name!r} is already served; unload it first or pick another name.")
        if len(self._named) >= self.config.max_loras:
            raise ValueError(f"{len(self._named)} LoRA adapters are loaded, the most --max-loras "
                             f"({self.config.max_loras}) allows; unload one or raise --max-loras.")
        request = LoRARequest(name, next(self._next_id) + 1_000_000_000, path)  # ids apart from offline users'
        self.check(request)
        with self._lock:
            self._named[name] = request
        return request

    def unload(self, name: str) -> None:
        with self._lock:
            if self._named.pop(name, None) is None:
                raise KeyError(f"No LoRA adapter named {name!r} is loaded.")

    def get(self, name: str) -> LoRARequest | None:
        return self._named.get(name)

    def named(self) -> list[LoRARequest]:
        return list(self._named.values())
