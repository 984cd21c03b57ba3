"""Beyond one device: a model placed by accelerate's device map (layers offloaded to disk) and a model sharded by
tensor parallelism over two gloo processes, each decoding greedily exactly as plain greedy decoding does.

The runs go through `recguide_hf.testing.split_check` (the GPU session runs the same script with CUDA): per prompt
batch (one prompt; a left-padded batch of four) it records plain greedy (`hf`: HF's generate, or NLD's own
`ar_generate`) and the engine's plain steps, LinearSS and RecGuide, with each round's planned block sizes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from recguide_hf.models.cache import RowCache
from recguide_hf.testing import split_check
from recguide_hf.testing.nld_standin import write_standin_folder

pytest.importorskip("accelerate")

CASES = split_check.CASES


def test_each_layer_is_sized_by_the_states_it_writes():
    """A layer's buffers are made at its first write, with that layer's head count (a tensor-parallel rank's
    slice), dtype and device; slots reached before a layer was made are zeros in it too."""
    cache = RowCache(num_layers=2, num_rows=2, capacity=10)
    rows = torch.arange(2)
    cache.bind(rows, 3)
    k0 = torch.randn(2, 2, 3, 4)
    cache.update(k0, k0, 0)
    assert cache.keys[0].shape == (2, 2, 10, 4) and cache.keys[1] is None
    cache.commit(rows, torch.tensor([3, 3]))
    cache.bind(rows, 2)  # layer 1 writes for the first time after layer 0's slots 0..4 were reached
    k1 = torch.randn(2, 1, 2, 4, dtype=torch.float64)
    keys, _ = cache.update(k1, k1, 1)
    assert cache.keys[1].shape == (2, 1, 10, 4) and cache.keys[1].dtype == torch.float64
    assert keys.shape == (2, 1, 5, 4)
    assert not keys[:, :, :3].any() and torch.equal(keys[:, :, 3:5], k1)  # never written: zeros, not garbage


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    return {"tiny": split_check.write_tiny_folder(root / "tiny"), "nld": write_standin_folder(root / "nld")}


@pytest.fixture(scope="module")
def single(folders):
    """The reference: each folder decoded in one process on one device."""
    return {name: split_check.run(split_check.load(str(path), False, None, None), 16, 0)
            for name, path in folders.items()}


def assert_lossless(record: dict, reference: dict | None = None):
    """Every engine method equals plain greedy of the same run, and that equals the one-device reference's; the
    drafting adapter's logits (routed every way) equal the one-device ones to rounding (the split sums in another
    order), and differ from the adapter-off logits (the adapter is at work): `split_check.problems`."""
    assert split_check.problems(record, reference) == []


OFFLOADED = {  # layer 1 of each model is offloaded to disk: its weights load from there for each forward
    "tiny": {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
             "model.rotary_emb": "cpu", "lm_head": "cpu"},
    "nld": {"encoder.embed_tokens": "cpu", "encoder.layers.0": "cpu", "encoder.layers.1": "disk",
            "encoder.norm": "cpu", "diffusion_head": "cpu"},
}


@pytest.mark.parametrize("name", ["tiny", "nld"])
def test_device_map_with_a_layer_offloaded_to_disk(folders, single, name, tmp_path):
    model = split_check.load(str(folders[name]), False, OFFLOADED[name], str(tmp_path / "offload"))
    record = split_check.run(model, 16, 0)
    assert record["draft_probe"]["offloaded"] > 0  # offloaded for real: those weights sit on `meta`
    assert_lossless(record, single[name])


def test_device_map_auto_within_a_memory_budget(folders, single, tmp_path):
    """`device_map="auto"` with a `max_memory` too small for the whole model: accelerate offloads what is left."""
    from transformers import AutoModelForCausalLM

    def load(**kw):
        return AutoModelForCausalLM.from_pretrained(folders["tiny"], trust_remote_code=True, dtype=torch.float32,
                                                    device_map="auto", max_memory={"cpu": "150KB"},
                                                    offload_folder=str(tmp_path / "offload"), **kw).eval()

    if not any(hasattr(m, "_hf_hook") for m in load(draft_adapter=False).modules()):
        pytest.skip("this transformers version offloads the whole model with no accelerate hook to load it back "
                    "(seen on 5.0.0: plain HF generate fails on it too)")
    model = load()
    assert any(p.device.type == "meta" for p in model.parameters())  # offloaded (5.0 keeps no hf_device_map here)
    assert_lossless(split_check.run(model, 16, 0), single["tiny"])


@pytest.mark.parametrize("setting, value", [("recguide_compile", True), ("recguide_overlap", "streams")])
def test_what_a_split_model_cannot_run_yet_names_its_setting(folders, tmp_path, setting, value):
    import recguide_hf

    model = split_check.load(str(folders["nld"]), False, OFFLOADED["nld"], str(tmp_path / "offload"))
    ids = torch.tensor([[20, 21, 22]])
    with pytest.raises(ValueError, match=f"{setting}={value!r} does not support a model placed by a device map"):
        recguide_hf.generate(model, input_ids=ids, max_new_tokens=4, **{setting: value})


def test_max_time_is_refused_under_tensor_parallelism(folders, monkeypatch):
    """A clock per rank would stop tensor-parallel ranks at different rounds (and leave the others waiting in a
    collective): `max_time` is an error there. (The model is marked tensor-parallel by hand: one process.)"""
    import recguide_hf
    from recguide_hf.models import hf_backbone

    model = split_check.load(str(folders["tiny"]), False, None, None)
    monkeypatch.setattr(hf_backbone, "tp_group", lambda model: SimpleNamespace(size=lambda: 2))
    with pytest.raises(ValueError, match="max_time"):
        recguide_hf.generate(model, input_ids=torch.tensor([[20, 21, 22]]), max_new_tokens=4, max_time=5.0,
                             recguide_mode="linear")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tensor_parallel(folder, out, ranks: int = 2) -> list[dict]:
    """`split_check` under torchrun: `ranks` gloo processes, rendezvous on 127.0.0.1, one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={ranks}",
           "--master-addr", "127.0.0.1", f"--master-port={_free_port()}", "-m", "recguide_hf.testing.split_check",
           "--model", str(folder), "--tp", "--out", str(out), "--max-new-tokens", "16"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "nld"])
def test_tensor_parallel_over_two_gloo_ranks(folders, single, name, tmp_path):
    """Two ranks, each holding half of every layer's heads (1 of 2 KV heads) and MLP columns, and the drafting
    LoRA sliced with its layers: both ranks decode the same rows, plan the same block sizes round by round, and
    equal plain greedy under the same sharding and on one device."""
    rank0, rank1 = run_tensor_parallel(folders[name], tmp_path / "out")
    assert single[name]["draft_probe"]["kv_heads"] == [2, 2]
    assert rank0["draft_probe"]["kv_heads"] == [1, 1] and rank0["draft_probe"]["sharded"] > 0  # sharded for real
    assert rank0 == rank1  # outputs, every round's plan, the adapter's logits, the sampled rows from one seed
    assert all(rank0[case]["sampled"] != rank0[case]["recguide"] for case in CASES)  # sampling, not greedy
    assert_lossless(rank0, single[name])
    plans = [p for case in CASES for p in rank0[case]["recguide_plans"]]
    assert plans and len({b for plan in plans for b in plan}) > 1  # the policy chose, round by round
