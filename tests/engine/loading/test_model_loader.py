"""The packaged embedder's unzipped directory is keyed by the zip's contents."""
import importlib.util
import os
import zipfile

from cpuserve.loading import model_loader


def fake_package(tmp_path, monkeypatch, config: str):
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    with zipfile.ZipFile(pkg / "model.zip", "w") as z:
        z.writestr("config.json", config)
        z.writestr("tokenizer.json", "{}")
    spec = importlib.util.spec_from_loader("all_minilm_l6_v2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(model_loader.importlib.util, "find_spec",
                        lambda name: spec if name == "all_minilm_l6_v2" else None)
    monkeypatch.setenv("CPUSERVE_CACHE", str(tmp_path / "cache"))
    return pkg / "model.zip"


def test_reinstall_reuses_the_directory_new_contents_do_not(tmp_path, monkeypatch):
    zp = fake_package(tmp_path, monkeypatch, '{"a": 1}')
    first = model_loader.packaged_embedder_dir()
    assert (first / "config.json").read_text() == '{"a": 1}'
    os.utime(zp, (1_000_000_000, 1_000_000_000))  # the same package installed again
    assert model_loader.packaged_embedder_dir() == first
    fake_package(tmp_path, monkeypatch, '{"a": 2}')  # a new version
    second = model_loader.packaged_embedder_dir()
    assert second != first and (second / "config.json").read_text() == '{"a": 2}'
    assert sorted(p.name for p in (tmp_path / "cache" / "packaged").iterdir()) == sorted([first.name, second.name])
