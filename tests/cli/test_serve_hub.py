"""`kvfence serve --model ORG/NAME[:FILE]` resolves Hugging Face repositories through
huggingface_hub, tested offline (HF_HUB_OFFLINE=1) against a cache this module writes in the
hub's own layout (tests/fixtures/hub_cache.py) under a private HF_HOME."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clients import Client
from service.model import load_model
from service.model.hub import HubModel, parse_hub_name
from tests.cli.conftest import clean_env, free_port, kvfence
from tests.fixtures.fake_hub import fake_hub
from tests.fixtures.hub_cache import write_hub_repo
from tests.serverutil import TenantSpec, start_server_process, write_tenants_file

MAIN = "a" * 40
PINNED = "b" * 40


@pytest.fixture(scope="module")
def hf_home(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """org/tiny: a safetensors directory model; org/ggufs: two GGUFs of it; org/one-gguf:
    one GGUF at main and, at commit PINNED (no branch), the other."""
    from tests.fixtures.tiny_gguf import write_gguf_from_hf

    home = tmp_path_factory.mktemp("hf-home")
    ggufs = tmp_path_factory.mktemp("ggufs")
    first = write_gguf_from_hf(tiny_llama_dir, ggufs / "first.gguf")
    second = write_gguf_from_hf(tiny_llama_dir, ggufs / "second.gguf")
    files = {p.name: p for p in tiny_llama_dir.iterdir() if p.is_file()}
    write_hub_repo(home, "org/tiny", files, commit=MAIN)
    write_hub_repo(home, "org/ggufs", {"tiny-q.gguf": first, "tiny-f.gguf": second,
                                       "README.md": tiny_llama_dir / "config.json"}, commit=MAIN)
    write_hub_repo(home, "org/one-gguf", {"only.gguf": first}, commit=MAIN)
    write_hub_repo(home, "org/one-gguf", {"pinned.gguf": second}, commit=PINNED, branch=None)
    return home


def offline(hf_home: Path) -> dict[str, str]:
    return clean_env({"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})


def resolve(hf_home: Path, *names: str, endpoint: str | None = None) -> list[str]:
    """What service.model.hub resolves each name (``ORG/NAME[:FILE][@REVISION]``) to, in one
    process whose huggingface_hub reads this module's HF_HOME and HF_HUB_OFFLINE (or, with
    ``endpoint``, HF_ENDPOINT and no offline mode) at import, as `kvfence serve`'s does."""
    env = offline(hf_home) if endpoint is None else clean_env(
        {"HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    code = ("import sys\nfrom service.model.hub import parse_hub_name, resolve_hub_model\n"
            "from service.model.load_error import ModelLoadError\n"
            "for arg in sys.argv[1:]:\n"
            "    name, _, revision = arg.partition('@')\n"
            "    hub = parse_hub_name(name)\n    assert hub is not None\n"
            "    try:\n"
            "        print(resolve_hub_model(hub, revision=revision or None, progress=False))\n"
            "    except ModelLoadError as e:\n        print('refused:', e)\n")
    run = subprocess.run([sys.executable, "-c", code, *names], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return run.stdout.splitlines()


def test_serve_org_name_serves_the_cached_directory_model(tmp_path: Path, hf_home: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    keys = write_tenants_file(tenants, {"acme": TenantSpec()})
    process = start_server_process(Path("org/tiny"), tenants, env=offline(hf_home))
    try:
        with Client(process.target, api_key=keys["acme"]) as client:
            [model] = client.models(timeout=30)
            result = client.generate_text("hello", max_tokens=4, ignore_eos=True, timeout=60)
    finally:
        process.stop()
    assert (model.name, model.architecture) == ("org/tiny", "llama")
    assert len(result.token_ids) == 4
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / MAIN
    assert any(str(snapshot) in line for line in process.output if "model.loading" in line)


def test_file_picks_a_gguf_and_it_loads(hf_home: Path) -> None:
    [resolved] = resolve(hf_home, "org/ggufs:tiny-f.gguf")
    path = Path(resolved)
    assert path == hf_home / "hub" / "models--org--ggufs" / "snapshots" / MAIN / "tiny-f.gguf"
    loaded = load_model(path, dtype="float32", progress=False)
    assert (loaded.name, loaded.model.config.arch) == ("tiny-f.gguf", "llama")


def test_a_repo_with_one_gguf_is_that_file_and_revision_pins(hf_home: Path) -> None:
    snapshots = hf_home / "hub" / "models--org--one-gguf" / "snapshots"
    assert resolve(hf_home, "org/one-gguf", f"org/one-gguf@{PINNED}") == [
        str(snapshots / MAIN / "only.gguf"), str(snapshots / PINNED / "pinned.gguf")]


def test_a_repo_with_safetensors_is_a_directory(hf_home: Path) -> None:
    assert resolve(hf_home, "org/tiny") == [str(hf_home / "hub" / "models--org--tiny"
                                                / "snapshots" / MAIN)]


def serve_refusal(hf_home: Path, tmp_path: Path, *flags: str) -> tuple[int, list[str]]:
    tenants = tmp_path / "tenants.toml"
    write_tenants_file(tenants, {"acme": TenantSpec()})
    run = kvfence("serve", "--log-format", "json", "--port", str(free_port()),
                  "--tenants", str(tenants), *flags, env=offline(hf_home), timeout=120)
    assert run.stdout == ""
    return run.returncode, run.stderr.splitlines()


def test_several_ggufs_are_refused_in_one_line_listing_them(hf_home: Path,
                                                           tmp_path: Path) -> None:
    assert serve_refusal(hf_home, tmp_path, "--model", "org/ggufs") == (2, [
        "kvfence: error: --model org/ggufs: the repository holds 2 GGUF files; pick one with "
        "--model org/ggufs:FILE, FILE one of tiny-f.gguf, tiny-q.gguf"])


def test_a_repo_missing_offline_is_refused_in_one_line(hf_home: Path, tmp_path: Path) -> None:
    cache = hf_home / "hub"
    assert serve_refusal(hf_home, tmp_path, "--model", "org/missing") == (2, [
        f"kvfence: error: --model org/missing: not in the Hugging Face cache ({cache}) and "
        "HF_HUB_OFFLINE is set; fetch it first with `hf download org/missing` "
        "(or unset HF_HUB_OFFLINE)"])
    assert serve_refusal(hf_home, tmp_path, "--model", "org/tiny:absent.gguf",
                         "--revision", PINNED) == (2, [
        f"kvfence: error: --model org/tiny:absent.gguf: not in the Hugging Face cache ({cache}) "
        f"at revision {PINNED} and HF_HUB_OFFLINE is set; fetch it first with "
        f"`hf download org/tiny absent.gguf --revision {PINNED}` (or unset HF_HUB_OFFLINE)"])


def test_which_names_are_repositories() -> None:
    assert parse_hub_name("org/name") == HubModel("org/name")
    assert parse_hub_name("Org-1/Name_2.5B:sub/x.gguf") == HubModel("Org-1/Name_2.5B", "sub/x.gguf")
    for path in ("models/tiny.gguf", "./org/name", "/org/name", "~/org/name", "a/b/c", "name"):
        assert parse_hub_name(path) is None, path


def test_file_must_be_a_gguf(hf_home: Path, tmp_path: Path) -> None:
    assert serve_refusal(hf_home, tmp_path, "--model", "org/tiny:config.json") == (2, [
        "kvfence: error: --model org/tiny:config.json: FILE must be a .gguf file inside "
        "org/tiny"])


def test_online_the_hub_is_listed_and_downloads_land_in_its_cache(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama_dir.iterdir() if p.is_file()}
    repos = {"org/tiny": files, "org/ggufs": {"a.gguf": b"GGUF-a", "b.gguf": b"GGUF-b"}}
    home = tmp_path / "hf-home"
    with fake_hub(repos, commit=MAIN) as endpoint:
        several, picked, directory, absent = resolve(
            home, "org/ggufs", "org/ggufs:b.gguf", "org/tiny", "org/absent", endpoint=endpoint)
    assert several == ("refused: --model org/ggufs: the repository holds 2 GGUF files; pick "
                       "one with --model org/ggufs:FILE, FILE one of a.gguf, b.gguf")
    assert absent == ("refused: --model org/absent: no such local path, nor repository on the "
                      "Hugging Face Hub (a private one needs HF_TOKEN)")
    snapshots = home / "hub" / "models--org--ggufs" / "snapshots" / MAIN
    assert picked == str(snapshots / "b.gguf") and Path(picked).read_bytes() == b"GGUF-b"
    assert not (snapshots / "a.gguf").exists()  # only the file asked for
    assert directory == str(home / "hub" / "models--org--tiny" / "snapshots" / MAIN)
    assert {p.name: p.read_bytes() for p in Path(directory).iterdir()} == files
    # What was downloaded serves offline from the cache afterwards.
    assert resolve(home, "org/ggufs:b.gguf") == [picked]
