"""lm-eval tasks, the `recguide` lm-eval backend and the local `evaluate` metric modules (all offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recguide_hf import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "eval" / "tasks"
METRICS = ROOT / "eval" / "metrics"
TOKENIZER = BUNDLED_MODEL
TASK_NAMES = ("recguide_stdlib_nextline", "recguide_shakespeare_nextline")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def loaded_tasks(tmp_path_factory):
    """The group loaded through lm-eval's TaskManager from a working directory that is not the repository."""
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    try:
        manager = TaskManager(include_path=str(TASKS))
        loaded = manager.load(["recguide_local"])
        docs = {name: list(task.test_docs()) for name, task in loaded["tasks"].items()}
    finally:
        os.chdir(cwd)
    return manager, loaded, docs


def test_tasks_and_group_are_indexed(loaded_tasks):
    manager, loaded, _ = loaded_tasks
    assert {"recguide_local", *TASK_NAMES} <= set(manager.all_tasks)
    assert set(loaded["tasks"]) == set(TASK_NAMES)
    assert [g.name for g in loaded["groups"].values()] == ["recguide_local"]


def test_task_data_resolves_from_the_task_file(loaded_tasks):
    _, loaded, docs = loaded_tasks
    for name in TASK_NAMES:
        assert len(docs[name]) == 64, name
        assert all(d["prompt"].strip() and d["target"].strip() for d in docs[name])
    code = loaded["tasks"]["recguide_stdlib_nextline"]
    prose = loaded["tasks"]["recguide_shakespeare_nextline"]
    doc = docs["recguide_stdlib_nextline"][0]
    assert code.doc_to_text(doc) == doc["prompt"].rstrip()  # the model writes the line break and indentation
    assert code.config.generation_kwargs["until"] == []
    doc = docs["recguide_shakespeare_nextline"][0]
    assert prose.doc_to_text(doc) == doc["prompt"] and prose.config.generation_kwargs["until"] == ["\n"]


def test_process_results_hand_checked(loaded_tasks):
    _, loaded, _ = loaded_tasks
    code = loaded["tasks"]["recguide_stdlib_nextline"]
    prose = loaded["tasks"]["recguide_shakespeare_nextline"]
    doc = {"prompt": "def f():\n    x = 1\n\n", "target": "    return x"}
    # the prompt ended in two line breaks, so the prediction is generated line 2 (after "" and "")
    assert code.process_results(doc, ["\n\n    return x\nmore"]) == {"exact_match": 1.0, "edit_similarity": 1.0}
    assert code.process_results(doc, ["\n    return x"])["exact_match"] == 0.0  # a blank line is missing
    got = code.process_results(doc, ["\n\n    return y\n"])
    assert got["exact_match"] == 0.0 and got["edit_similarity"] == pytest.approx(1 - 1 / 8)
    doc = {"prompt": "Lear.\n", "target": "kitten"}
    assert prose.process_results(doc, ["sitting"]) == {"exact_match": 0.0,
                                                       "edit_similarity": pytest.approx(1 - 3 / 7)}
    assert prose.process_results(doc, ["  kitten \nignored"])["exact_match"] == 1.0


def test_metric_modules_load_offline_from_another_directory(tmp_path):
    script = f"""
import json, evaluate
parity = evaluate.load({str(METRICS / "token_parity")!r})
acceptance = evaluate.load({str(METRICS / "acceptance")!r})
print(json.dumps({{
    "parity": parity.compute(predictions=[[1, 2, 3], [1, 2, 4], [5], [1, 2]],
                             references=[[1, 2, 3], [1, 2, 3], [6, 7], [1, 2, 3]]),
    "same": parity.compute(predictions=[[7, 8]], references=[[7, 8]]),
    "acceptance": acceptance.compute_stats([
        {{"new_tokens": 8, "forwards": 2, "rounds": 2, "accepted_drafts": 6, "drafted": 14, "hits": {{}}}},
        {{"new_tokens": 4, "forwards": 4, "rounds": 2, "accepted_drafts": 2, "drafted": 14}}]),
}}))
"""
    env = {**os.environ, **OFFLINE}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    parity = got["parity"]
    # prefixes 3, 2, 0, 2; pairs 2-4 differ at 2, 0, 2
    assert parity["exact_match"] == 0.25 and parity["num_diverged"] == 3
    assert parity["mean_common_prefix"] == pytest.approx(7 / 4)
    assert parity["mean_prefix_fraction"] == pytest.approx((1 + 2 / 3 + 0 + 2 / 3) / 4)
    assert parity["mean_first_divergence"] == pytest.approx(4 / 3) and parity["min_first_divergence"] == 0
    assert got["same"]["exact_match"] == 1.0 and got["same"]["mean_first_divergence"] is None
    acc = got["acceptance"]
    assert acc["tpf"] == pytest.approx(12 / 6) and acc["tau"] == pytest.approx(12 / 4)
    assert acc["acceptance"] == pytest.approx(8 / 28)
    assert acc["mean_request_tpf"] == pytest.approx((4 + 1) / 2) and acc["mean_request_tau"] == pytest.approx(3.0)


def test_backend_summary_matches_acceptance_definitions():
    from recguide_hf.integrations.lm_eval_backend import summarize

    per_request = [
        {"new_tokens": 8, "forwards": 2, "rounds": 2, "accepted_drafts": 6, "drafted": 14, "branch_rounds": 2,
         "hits": {"continuation": 1, "correction_1": 0}, "block_sizes": {16: 2}},
        {"new_tokens": 4, "forwards": 4, "rounds": 2, "accepted_drafts": 2, "drafted": 14, "branch_rounds": 2,
         "hits": {"continuation": 0, "correction_1": 1}, "block_sizes": {8: 1, 16: 1}},
    ]
    s = summarize(per_request)
    assert s["requests"] == 2 and s["new_tokens"] == 12 and s["forwards"] == 6
    assert s["tpf"] == pytest.approx(2.0) and s["tau"] == pytest.approx(3.0)
    assert s["acceptance"] == pytest.approx(8 / 28) and s["coverage"] == pytest.approx(2 / 4)
    assert s["hits"] == {"continuation": 1, "correction_1": 1} and s["block_sizes"] == {8: 1, 16: 3}
    assert summarize([])["tpf"] == 0.0


def _tiny_folder(directory: Path) -> Path:
    import torch
    from transformers import AutoTokenizer

    from recguide_hf import RecGuideConfig, RecGuideForCausalLM
    from recguide_hf.models.export import save_model_folder

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    config = RecGuideConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, mask_token_id=tokenizer.mask_token_id,
                            initializer_range=0.3, tie_word_embeddings=False, block_size=8)
    model = RecGuideForCausalLM(config).eval()
    return save_model_folder(model, tokenizer, directory, recguide_block_size=8)


@pytest.mark.slow
def test_tiny_lm_eval_run_ar_and_recguide_agree(tmp_path):
    """The stock `hf` backend through the folder's custom_generate, `--gen_kwargs recguide_mode=ar` and `=recguide`:
    identical responses; the `recguide` backend: the same text (both cut at the task's max_gen_toks; a cut may split
    a character) and RecGuide statistics in the results' config."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import recguide_hf.integrations.lm_eval_backend  # noqa: F401  (registers --model recguide)

    folder = _tiny_folder(tmp_path / "tiny")
    manager = TaskManager(include_path=str(TASKS))
    runs = {}
    for model, mode in (("hf", "ar"), ("hf", "recguide"), ("recguide", "recguide")):
        runs[model, mode] = lm_eval.simple_evaluate(
            model=model, model_args=f"pretrained={folder},trust_remote_code=True", device="cpu", batch_size=2,
            tasks=list(TASK_NAMES), limit=2, gen_kwargs=f"recguide_mode={mode}", log_samples=True,
            task_manager=manager, bootstrap_iters=0)
    for task in TASK_NAMES:
        responses = {key: [s["resps"][0][0] for s in sorted(r["samples"][task], key=lambda s: s["doc_id"])]
                     for key, r in runs.items()}
        assert len(responses["hf", "ar"]) == 2 and responses["hf", "ar"] == responses["hf", "recguide"], task
        for short, full in zip(responses["recguide", "recguide"], responses["hf", "ar"]):
            assert short and full.startswith(short.rstrip("\ufffd")), task  # a cut may split a character
    stats = runs["recguide", "recguide"]["config"]["recguide_stats"]
    assert stats["modes"] == ["recguide"] and stats["requests"] == 4 and stats["new_tokens"] > 0
    assert stats["tpf"] > 0 and sum(stats["block_sizes"].values()) == stats["rounds"]


@pytest.mark.slow
def test_data_parallel_two_cpu_processes(tmp_path):
    """`accelerate launch` with two CPU processes: the requests are split and the results gathered."""
    folder = _tiny_folder(tmp_path / "tiny")
    env = {**os.environ, **OFFLINE, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           "-m", "recguide_hf.integrations.lm_eval_backend", "--model", "recguide",
           "--model_args", f"pretrained={folder}",
           "--device", "cpu", "--include_path", str(TASKS), "--tasks", "recguide_shakespeare_nextline",
           "--limit", "4", "--batch_size", "2", "--log_samples", "--output_path", str(tmp_path / "out")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()
    assert len(samples) == 4
    stats = results["config"]["recguide_stats"]
    assert stats["generate_calls"] == 2 and stats["requests"] == 4  # one batch of 2 on each process


@pytest.mark.slow
def test_model_parallel_offloaded_responses_equal_plain_greedy(tmp_path):
    """lm-eval's model parallelism (`parallelize=True`: accelerate's device map) with a CPU memory budget too small
    for the model, so accelerate offloads layers to disk: the `recguide` backend's responses equal the stock
    backend's plain greedy ones on one device."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from recguide_hf.integrations.lm_eval_backend import RecGuideLM

    folder = _tiny_folder(tmp_path / "tiny")
    manager = TaskManager(include_path=str(TASKS))
    placed = RecGuideLM(pretrained=str(folder), parallelize=True, max_cpu_memory="150KB",
                        offload_folder=str(tmp_path / "off"), batch_size=2, device="cpu")
    assert any(p.device.type == "meta" for p in placed.model.parameters())  # layers offloaded for real
    runs = {}
    for key, model, args, mode in (("hf", "hf", f"pretrained={folder},trust_remote_code=True", "ar"),
                                   ("recguide", placed, None, "recguide")):
        runs[key] = lm_eval.simple_evaluate(
            model=model, model_args=args, device="cpu", batch_size=2, tasks=list(TASK_NAMES), limit=2,
            gen_kwargs=f"recguide_mode={mode}", log_samples=True, task_manager=manager, bootstrap_iters=0)
    for task in TASK_NAMES:
        responses = {key: [s["resps"][0][0] for s in sorted(r["samples"][task], key=lambda s: s["doc_id"])]
                     for key, r in runs.items()}
        assert len(responses["hf"]) == 2
        for short, full in zip(responses["recguide"], responses["hf"]):
            assert short and full.startswith(short.rstrip("\ufffd")), task  # a cut may split a character
    assert runs["recguide"]["config"]["recguide_stats"]["requests"] == 4
