"""Process groups: one process needs none (size-1 groups whose collectives return their input), and with several
ranks the tensor- and pipeline-parallel groups follow vLLM's layout (rank = pp_rank * tp + tp_rank) and their
collectives reach exactly their members."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_launcher import run_ranks

from pagellm.distributed import get_pp_group, get_tp_group, init_distributed_environment, initialize_model_parallel


def test_one_process_needs_no_process_group():
    init_distributed_environment(world_size=1, rank=0)
    initialize_model_parallel(1, 1)
    assert not dist.is_initialized()
    tp = get_tp_group()
    assert (tp.rank, tp.world_size, tp.ranks, tp.group) == (0, 1, [0], None)
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x and tp.all_gather(x, dim=0) is x
    assert get_pp_group().world_size == 1
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        initialize_model_parallel(2, 1)


def _groups_and_collectives() -> dict:
    tp, pp = get_tp_group(), get_pp_group()
    rank = float(dist.get_rank())
    return dict(tp=(tp.rank, tp.world_size, tp.ranks), pp=(pp.rank, pp.world_size, pp.ranks),
                tp_sum=tp.all_reduce(torch.tensor([rank])).item(), pp_sum=pp.all_reduce(torch.tensor([rank])).item(),
                tp_gather=tp.all_gather(torch.full((2, 1), rank), dim=1).tolist())


def test_group_layout_and_collectives(tmp_path):
    tp_size, pp_size = 2, 2
    results = run_ranks(_groups_and_collectives, tmp_path, tp_size, pp_size)
    for rank, result in enumerate(results):
        pp_rank, tp_rank = divmod(rank, tp_size)
        tp_ranks = [pp_rank * tp_size + i for i in range(tp_size)]
        pp_ranks = [p * tp_size + tp_rank for p in range(pp_size)]
        assert result["tp"] == (tp_rank, tp_size, tp_ranks)
        assert result["pp"] == (pp_rank, pp_size, pp_ranks)
        assert result["tp_sum"] == sum(tp_ranks) and result["pp_sum"] == sum(pp_ranks)
        assert result["tp_gather"] == [[float(r) for r in tp_ranks]] * 2
