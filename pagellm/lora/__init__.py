"""Multi-LoRA (vLLM's --enable-lora): PEFT adapters applied per request over unchanged base weights.

`request.py`: `LoRARequest`, what a request names its adapter by; `peft.py`: reading and checking a PEFT adapter
directory; `registry.py`: the engine's adapters by name (--lora-modules, the load/unload endpoints) and the checks
a request's adapter passes before it is queued; `weights.py`: an adapter laid out on the model's (fused) layers;
`worker_manager.py`: the worker's loaded adapters (LRU) and each step's rows per adapter; `context.py`: the step's
adapter rows, read by the linear layers (vLLM's punica wrapper / forward context).
"""
from pagellm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
