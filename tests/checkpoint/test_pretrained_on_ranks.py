"""pipe.load_pretrained / save_pretrained on gloo ranks (issue 29): a GPT-2 built under
``vf.deferred_init`` + ``vf.skip_init`` loads transformers' sharded save with each rank reading
only its own stages' tensors (counted per key), at P = 4 as two virtual stages on each of 2
ranks, D = 2 with ZeRO-1; after one SGD step the ranks' export opens in
``AutoModelForCausalLM.from_pretrained`` holding exactly their tensors, equal to eager's step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import varuna_fx.checkpoint.hf.safetensors_files as files
from support.dist import launch_ok
from support.pretrained import IDS, gpt2_config, tf

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TIED = "lm_head.weight"


def eager_step(reference_dir: Path) -> dict[str, torch.Tensor]:
    model = tf.GPT2LMHeadModel.from_pretrained(reference_dir)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    return model.state_dict()


def test_each_rank_reads_its_share_and_the_export_opens_in_transformers(tmp_path: Path) -> None:
    # 4 stages, 2 per rank (interleaved), 2 replicas with ZeRO-1: 4 ranks, one launch
    ranks, stages, per_rank = 4, 4, 2
    torch.manual_seed(0)
    reference = tf.GPT2LMHeadModel(gpt2_config())
    reference.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    want = {k: v for k, v in reference.state_dict().items() if k != TIED}
    launch_ok("pretrained_rank.py", ranks,
              [str(tmp_path), str(tmp_path / "hf"), str(stages), str(per_rank)], timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks)]
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert "never loaded" in result["before"]  # skip_init: no step before the load
        held = result["loaded"]
        assert 0 < len(held) < len(want)  # a share, not the model
        for name, t in held.items():
            assert t.equal(want[name]), name
        # each rank read exactly the tensors it holds, each once, and nothing else
        assert result["reads"] == {k: v.numel() * v.element_size() for k, v in held.items()}
        assert result["bytes_read"] == sum(result["reads"].values())
        merged.update(result["after"])
    assert merged.keys() == want.keys()
    index = json.loads((tmp_path / "export" / files.INDEX).read_text())
    assert len(set(index["weight_map"].values())) == stages and TIED not in index["weight_map"]
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    exported = back.state_dict()
    for name, t in merged.items():
        assert exported[name].equal(t), name
    eager = eager_step(tmp_path / "hf")
    for name, t in merged.items():
        torch.testing.assert_close(t, eager[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
