"""The wheel, used outside the repository: it carries the bundled model and the prompt sets, and its command line
runs from any folder (nothing at run time reads `eval/` or `tests/`)."""

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools stages files in ROOT/build/ and would carry a stale module from an earlier build into this wheel
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)],
                       check=True, capture_output=True, timeout=600)
    finally:
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    (path,) = out.glob("recguide_hf-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_carries_the_model_and_the_prompts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    folder = "recguide_hf/bundled/recguide-tiny/"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "cost_table.json",
                 "value_table.json", "modeling_recguide.py", "custom_generate/generate.py",
                 "draft_lora/adapter_model.safetensors", "draft_lora/adapter_config.json"):
        assert folder + name in names, name
    for name in ("heldout_code.jsonl", "heldout_prose.jsonl"):
        assert "recguide_hf/bundled/prompts/" + name in names
    assert not any(n.startswith(("eval/", "tests/")) for n in names)


@pytest.mark.slow
def test_the_installed_wheel_runs_from_another_folder(wheel, tmp_path):
    """A venv that sees this environment's torch and transformers (a path line to its site-packages, whose own .pth
    files, this checkout's editable install among them, are then not run) but takes recguide_hf from the wheel."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    child_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    Path(child_site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args):
        return run_script(str(python), *args)

    def run_script(*cmd):
        return subprocess.run(list(cmd), cwd=elsewhere, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)

    where = run("-c", "import recguide_hf; print(recguide_hf.__file__, recguide_hf.BUNDLED_MODEL)")
    assert where.returncode == 0, where.stderr
    assert str(env_dir) in where.stdout and str(ROOT) not in where.stdout, where.stdout
    gen = run("-m", "recguide_hf", "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "16")
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("def add(a, b):") and "tokens/s" in gen.stdout
    bench = run("-m", "recguide_hf", "bench", "--quick", "--methods", "ar", "linear-4", "--concurrency", "1",
                "--out", str(tmp_path / "bench"))
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert (tmp_path / "bench" / "bench.json").exists()
    # the console script the wheel installs (its entry point names the CLI's module), small settings
    recguide = str(env_dir / "bin" / "recguide")
    profile = run_script(recguide, "profile", "--concurrency", "1", "--block-sizes", "1", "4", "--repeats", "1",
                         "--out", str(tmp_path / "cost_table.json"))
    assert profile.returncode == 0, profile.stderr[-2000:]
    assert json.loads((tmp_path / "cost_table.json").read_text())["costs"]["1"]["4"]["verify"]
    calibrate = run_script(recguide, "calibrate", "--num-prompts", "4", "--block-sizes", "1", "4",
                           "--max-new-tokens", "24", "--signal", "accepted", "--out", str(tmp_path / "values.json"))
    assert calibrate.returncode == 0, calibrate.stderr[-2000:]
    assert "4" in json.loads((tmp_path / "values.json").read_text())["values"]
