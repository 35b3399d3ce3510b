"""Process groups for tensor and pipeline parallelism and the collectives the model's layers call."""
from pagellm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)

__all__ = ["GroupCoordinator", "destroy_distributed_environment", "destroy_model_parallel", "get_pp_group",
           "get_tp_group", "init_distributed_environment", "initialize_model_parallel"]
