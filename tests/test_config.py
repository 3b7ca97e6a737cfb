import os

import pytest

from expertd.errors import ConfigError
from expertd.server.daemon.config import load_config

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    cfg = load_config(write(tmp_path, "checkpoint: ckpt\nendpoint: ipc://run/x.sock\nnamespace: abc\n"))
    assert cfg.checkpoint == os.path.join(str(tmp_path), "ckpt")
    assert cfg.endpoint == f"ipc://{tmp_path}/run/x.sock"
    assert cfg.namespace == "abc"
    assert cfg.index_path == os.path.join(str(tmp_path), "run", "abc.index.json")


def test_defaults_and_tcp(tmp_path):
    cfg = load_config(write(tmp_path, "checkpoint: /abs\nendpoint: tcp://127.0.0.1:5555\n"))
    assert cfg.checkpoint == "/abs" and cfg.endpoint == "tcp://127.0.0.1:5555" and cfg.namespace == "expertd"


@pytest.mark.parametrize(
    "text, match",
    [
        ("checkpoint: x\nbogus: 1\nalso_bad: 2\n", "unknown key\\(s\\) also_bad, bogus"),
        ("endpoint: ipc:///x\n", "'checkpoint'"),
        ("checkpoint: x\nendpoint: http://x\n", "endpoint"),
        ("checkpoint: x\nnamespace: 'a/b'\n", "namespace"),
        ("- a\n- b\n", "mapping"),
        ("checkpoint: [unclosed\n", "not valid YAML"),
        ("checkpoint: x\ndevice: tpu\n", "device"),
    ],
)
def test_bad_configs_are_named(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path / "nope.yaml"))
