"""URL sources: a source bundle as a tar archive, served by a real HTTP server on 127.0.0.1,
downloaded and loaded by ``load_source`` and compiled and pushed by a real ``cuvil-worker``.
Anything but plain data files, and any redirect, is refused with the URL named."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cuvil_worker import contract

from cuvil.frontend.source_bundle import SourceBundleError
from cuvil.frontend.sources import load_source
from cuvil.frontend.url_bundle import bundle_name, fetch_url_bundle
from tests.cuvil_worker.test_sources import TEXT_INPUTS, tiny_bert
from tests.cuvil_worker.test_worker import mlp_spec
from tests.cuvil_worker.workers import compilation_request, start_worker, wait_done, worker_env
from tests.fixtures.http_files import Member, bundle_members, served, write_tar
from tests.fixtures.ports import free_port
from tests.fixtures.redis import RedisServer
from tests.fixtures.registry import RunningRegistry

__all__ = ["served", "tiny_bert"]


def _fetcher(tmp_path: Path) -> Callable[[str], Path]:
    return lambda url: fetch_url_bundle(url, tmp_path / "fetched")


def test_a_url_bundle_loads_the_model_it_holds(
    tiny_bert: Path, served: tuple[str, Path], tmp_path: Path
) -> None:
    base, www = served
    digest = write_tar(www / "tiny-bert.tar.gz", bundle_members(tiny_bert, folder="tiny-bert"))
    url = f"{base}/tiny-bert.tar.gz#sha256={digest.split(':')[1]}"
    loaded = load_source({"source": {"url": url}, **TEXT_INPUTS}, bundle_fetcher=_fetcher(tmp_path))
    assert loaded.name == "tiny-bert" == bundle_name(url)
    from transformers import BertModel

    original = BertModel.from_pretrained(str(tiny_bert)).eval()
    inputs = loaded.example_inputs
    with torch.no_grad():
        expected = original(**inputs).last_hidden_state
        got = loaded.model(**inputs).last_hidden_state
    torch.testing.assert_close(got, expected)
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == sorted(
        p.name for p in tiny_bert.iterdir() if p.is_file()
    ), "only the bundle's files, and no download left behind"


@pytest.mark.parametrize(
    ("members", "suffix", "message"),
    [
        ([("pytorch_model.bin", b"pickle", None)], "", "data only"),
        ([("config.json", b"{}", None), ("weights.safetensors", None, "/etc/passwd")], "",
         "regular files only"),
        ([("a/b/config.json", b"{}", None)], "", "regular files only"),
        ([("../config.json", b"{}", None)], "", "regular files only"),
        ([("a/config.json", b"{}", None), ("b/m.safetensors", b"x", None)], "", "several folders"),
        ([("config.json", b"{}", None)], "", "no \\*.safetensors"),
        ([("config.json", b"{}", None)], "#sha256=" + "0" * 64, "digest is sha256:"),
        ([("config.json", b"{}", None)], "#md5=0", "only fragment"),
    ],
)  # fmt: skip
def test_archives_that_are_not_plain_bundles_are_refused(
    members: list[Member], suffix: str, message: str, served: tuple[str, Path], tmp_path: Path
) -> None:
    base, www = served
    write_tar(www / "bad.tar.gz", members)
    with pytest.raises(SourceBundleError, match=message) as refused:
        fetch_url_bundle(f"{base}/bad.tar.gz{suffix}", tmp_path / "fetched")
    assert f"{base}/bad.tar.gz" in str(refused.value), "the URL is named"
    assert not (tmp_path / "config.json").exists() and not Path("/tmp/config.json").exists()


def test_downloads_that_go_wrong_say_why(served: tuple[str, Path], tmp_path: Path) -> None:
    base, www = served
    (www / "not-a-tar.tar").write_bytes(b"plain text")
    write_tar(www / "m.tar.gz", [("config.json", b"{}" * 1000, None)])
    cases = [
        (f"{base}/missing.tar.gz", {}, "HTTP 404"),
        (f"{base}/not-a-tar.tar", {}, "not a tar archive"),
        (f"{base}/moved/m.tar.gz", {}, "redirects are not followed"),
        (f"{base}/m.tar.gz", {"max_bytes": 100}, "larger than 100 bytes"),
        (f"{base}/m.tar.gz", {"max_bytes": 1500}, "unpacks into more than 1500 bytes"),
        ("ftp://127.0.0.1/m.tar.gz", {}, "not an http\\(s\\) URL"),
        (f"{base}/x/../m.tar.gz", {}, "path segments"),
        (f"http://127.0.0.1:{free_port()}/m.tar.gz", {"timeout": 2.0}, "download failed"),
    ]
    for url, options, message in cases:
        with pytest.raises(SourceBundleError, match=message):
            fetch_url_bundle(url, tmp_path / "fetched", **options)


def test_a_worker_compiles_and_pushes_a_url_source(
    tiny_bert: Path,
    served: tuple[str, Path],
    redis_server: RedisServer,
    registry: RunningRegistry,
    tmp_path: Path,
) -> None:
    base, www = served
    write_tar(www / "tiny-bert.tar.gz", bundle_members(tiny_bert))
    app = contract.create_app(redis_server.url(0), redis_server.url(1))
    spec = mlp_spec(registry, source={"url": f"{base}/tiny-bert.tar.gz"}, **TEXT_INPUTS)
    env = worker_env(redis_server.url(0), redis_server.url(1), tmp_path / "work",
                     CUVIL_WARM_UP="0", CUVIL_BENCH_ITERATIONS="3")  # fmt: skip
    worker = start_worker(env, tmp_path, name="url-source")
    try:
        worker.wait_ready()
        request = compilation_request(spec)
        contract.submit_compilation(app, request)
        progress = wait_done(app, request, timeout=240, workers=[worker])
    finally:
        worker.stop()
    assert progress.phase == contract.PHASE_SUCCEEDED, progress.error
    assert progress.result is not None
    (artifact,) = progress.result["artifacts"]
    assert artifact["digest"] in registry.manifests(spec["output"]["repository"])
    assert not (tmp_path / "work" / "sources").exists() or not any(
        (tmp_path / "work" / "sources").iterdir()
    ), "the download is not left in the work dir"


def test_cuvil_compile_fetches_a_url_source_as_the_worker_does(
    tiny_bert: Path, served: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cuvil_cli.main import main

    base, www = served
    write_tar(www / "tiny-bert.tar.gz", bundle_members(tiny_bert))
    spec = tmp_path / "bert.yaml"
    spec.write_text(
        "apiVersion: cuvil.dev/v1alpha1\nkind: ModelCompilation\nmetadata: {name: bert-url}\n"
        f"spec:\n  source: {{url: '{base}/tiny-bert.tar.gz'}}\n"
        "  inputs:\n    - {name: input_ids, dtype: int64, shape: [batch, seq]}\n"
        "    - {name: attention_mask, dtype: int64, shape: [batch, seq]}\n"
        "  dynamicDims: {batch: {min: 1, max: 4}, seq: {min: 4, max: 32}}\n"
        f"  targets: [cpu-x86_64]\n  output: {{repository: 'oci:{tmp_path / 'layout'}', tag: v1}}\n"
    )
    assert main(["compile", str(spec), "--bench-iterations", "2"]) == 0, capsys.readouterr().err
    assert f"oci:{tmp_path / 'layout'}:v1@sha256:" in capsys.readouterr().err
