"""``rollq atropos-env`` (``ops.atropos.serve_env``): atroposlib 0.4.0's quirks fixed in the
env's process, checked on atroposlib's own classes (the whole command runs in
``test_env_command_line``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("atroposlib", reason="atroposlib is not installed (pip install rollq[atropos])")

from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.server_handling.server_manager import ServerManager

from rollq.ops.atropos.serve_env import (
    PATIENCE_S,
    RETRIED,
    be_patient,
    fix_chat_template,
    fix_single_server,
)

URL = "http://127.0.0.1:8000/inference/v1"


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo the fixes after the test (they patch atroposlib / transformers classes)."""
    import transformers
    from atroposlib.envs.base import BaseEnv

    monkeypatch.setattr(ServerManager, "__init__", ServerManager.__init__)
    for name in RETRIED:
        monkeypatch.setattr(BaseEnv, name, getattr(BaseEnv, name))
    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "apply_chat_template",
                        transformers.PreTrainedTokenizerBase.apply_chat_template)


def _urls(configs: object) -> list[str]:
    return [server.config.base_url for server in ServerManager(configs).servers]


def test_a_lone_server_config_uses_its_base_url(restored: None, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from rollq.ops.local.tiny_model import _write_tokenizer

    _write_tokenizer(tmp_path, seed=0)  # the vllm server type loads its tokenizer
    lone = APIServerConfig(server_type="vllm", base_url=URL, model_name="m",
                           tokenizer_name=str(tmp_path))
    assert _urls(lone) == [f"http://localhost:{port}/v1" for port in range(9004, 9008)]
    fix_single_server()
    fix_single_server()  # idempotent
    manager = ServerManager(lone)
    assert [s.config.base_url for s in manager.servers] == [URL]
    assert manager.servers[0].config.api_key == "x"  # as atroposlib's baseline servers
    assert capsys.readouterr().err.count(f"using {URL}") == 1
    keyed = lone.model_copy(update={"api_key": "k"})
    assert _urls([keyed, keyed]) == [URL, URL]  # lists as before
    assert len(_urls(ServerBaseline(model_name="m"))) == 4  # no URL: atroposlib's default
    assert "pass --openai.base_url" in capsys.readouterr().err


def test_tokenize_for_trainer_posts_under_transformers_5(restored: None,
                                                         tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

    from rollq.ops.local.tiny_model import _write_tokenizer

    _write_tokenizer(tmp_path, seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": "What is 1 + 2?"},
            {"role": "assistant", "content": "#### 3"}]
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:  # the bug, as envs hit it
        with pytest.raises(TypeError, match="BatchEncoding"):
            json.dumps(tokenize_for_trainer(tokenizer, chat))
    fix_chat_template()
    posted = tokenize_for_trainer(tokenizer, chat)
    json.dumps(posted)
    assert posted["tokens"] == list(tokenizer.apply_chat_template(chat, return_dict=False))
    assert posted["masks"][-1] == posted["tokens"][-1] and posted["masks"][0] == -100
    assert isinstance(tokenizer.apply_chat_template(chat, tokenize=False), str)
    if major >= 5:  # an explicit return_dict is still honoured
        assert not isinstance(tokenizer.apply_chat_template(chat, return_dict=True), list)


def test_the_envs_api_calls_outlast_an_api_restart(restored: None) -> None:
    from atroposlib.envs.base import BaseEnv

    assert BaseEnv.get_status.retry.stop.max_attempt_number == 3  # atroposlib's: ~1-4 s
    be_patient()
    be_patient()  # idempotent
    for name in RETRIED:
        assert getattr(BaseEnv, name).retry.stop.max_delay == PATIENCE_S


def test_a_missing_env_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from rollq.ops.atropos.serve_env import main

    assert main(["no/such/env.py", "serve"]) == 2
    assert main(["not_a_target", "serve"]) == 2
    err = capsys.readouterr().err
    assert "no such env file: no/such/env.py" in err and "neither a .py file" in err
    assert main([]) == 2 and main(["--help"]) == 0
