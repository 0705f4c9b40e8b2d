"""`graphkiln serve` as a command: a hub id with --compile (found in graphkiln's compile cache, the API key
from the environment), the one-line errors (exit 2) before anything loads, and the switch interval it serves
under (GRAPHKILN_SERVE_SWITCH_INTERVAL)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import graphkiln
from artifact_helpers import single_error_line
from hub_helpers import HUB_REPO
from graphkiln import SamplingParams, cli, cli_serve
from graphkiln.models.switch_interval import SERVE_SWITCH_INTERVAL_ENV
from serve_helpers import Server, serve_process

pytestmark = pytest.mark.slow


def test_serve_a_hub_id_with_compile(hub_artifact: Path, hub_env: dict, artifact: Path) -> None:
    """`serve org/name --compile` serves the cached artifact under the hub id's name; GRAPHKILN_API_KEY guards it."""
    env = {**hub_env, "GRAPHKILN_API_KEY": "from-env"}
    args = (HUB_REPO, "--compile", "--kv-cache-tokens", "2048", "--capture", "blocking")  # answers of compiled pieces
    with serve_process(*args, env=env, api_key="from-env") as server:
        assert [m.id for m in server.client().models.list().data] == [HUB_REPO]
        got = server.client().completions.create(model=HUB_REPO, prompt="If the file", max_tokens=8, temperature=0)
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    with graphkiln.load(artifact, capture="blocking") as llm:
        assert got.choices[0].text == llm.generate("If the file", SamplingParams(max_tokens=8))[0].text
    assert not [line for line in server.log if "inductor" in line]  # found in the cache: nothing compiled


@pytest.mark.parametrize("argv, words", [
    (["serve", "{tmp}"], ["not a graphkiln artifact", "--compile"]),
    (["serve", "tiny", "--compile", "--trusted-key", "{tmp}/key.pem"], ["--trusted-key", "unsigned"]),
], ids=["not-an-artifact", "trusted-key-with-compile"])  # fmt: skip
def test_serve_refuses_bad_arguments_in_one_line(argv: list[str], words: list[str], tmp_path: Path, capsys) -> None:
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert all(word in line for word in words), line


@pytest.mark.parametrize("flags, words", [
    (("--quantization", "int4"), ["--quantization int4 needs --compile", "compiled already"]),
    (("--dtype", "bfloat16"), ["compiled for dtype 'float32', asked for 'bfloat16'"]),
    (("--device", "cuda"), ["compiled for device 'cpu', asked for 'cuda'"]),
], ids=["quantization", "dtype", "device"])  # fmt: skip
def test_compile_options_on_an_artifact_are_refused_or_checked(
    artifact: Path, flags: tuple[str, ...], words: list[str], capsys
) -> None:
    """Without --compile the artifact is served as it was compiled: an option that would change that is never
    silently dropped."""
    assert cli.main(["serve", str(artifact), "--port", "0", *flags]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert all(word in line for word in words), line


def test_a_port_in_use_is_said_before_the_model_loads(artifact: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(graphkiln, "load", lambda *a, **k: pytest.fail("loaded before binding"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", str(artifact), "--port", str(port)]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


@pytest.mark.parametrize("flags, words", [
    (["--port", "-1"], "--port: '-1' is not an integer in [0, 65535]"),
    (["--port", "70000"], "--port: '70000' is not an integer in [0, 65535]"),
    (["--api-key="], "--api-key: is empty"),  # not a server without authentication
    (["--served-model-name="], "--served-model-name: is empty"),
], ids=["negative-port", "port-past-65535", "empty-api-key", "empty-model-name"])  # fmt: skip
def test_serve_refuses_bad_flag_values_in_one_line(flags: list[str], words: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:  # argparse's usage errors exit by themselves
        cli.main(["serve", str(tmp_path), *flags])
    assert info.value.code == 2
    assert words in single_error_line(capsys.readouterr().err)


def test_an_empty_api_key_variable_is_refused_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("GRAPHKILN_API_KEY", "")
    assert cli.main(["serve", str(tmp_path)]) == 2
    assert "GRAPHKILN_API_KEY is set but empty" in single_error_line(capsys.readouterr().err)


def test_serve_without_its_extra_names_the_install_command(tmp_path: Path, capsys, monkeypatch) -> None:
    find_spec = cli_serve.importlib.util.find_spec
    monkeypatch.setattr(cli_serve.importlib.util, "find_spec", lambda name: None if name == "uvicorn" else find_spec(name))
    assert cli.main(["serve", str(tmp_path)]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert "uvicorn" in line and "pip install 'graphkiln[serve]'" in line


def test_a_bad_serve_switch_interval_is_said_before_the_model_loads(artifact: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(graphkiln, "load", lambda *a, **k: pytest.fail("loaded before the setting was read"))
    monkeypatch.setenv(SERVE_SWITCH_INTERVAL_ENV, "fast")
    assert cli.main(["serve", str(artifact), "--port", "0"]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert f"{SERVE_SWITCH_INTERVAL_ENV}='fast'" in line and "'off'" in line


def test_serve_runs_under_its_switch_interval_and_restores_it(artifact: Path, monkeypatch) -> None:
    """While `serve` answers requests the interpreter switches threads at most every `switch_interval`; the
    interval found before is back once it stops."""
    import uvicorn

    from graphkiln.serve import server as server_module
    from graphkiln.serve.app import ServerConfig

    started: list[uvicorn.Server] = []

    class Recorded(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            started.append(self)

    monkeypatch.setattr(server_module.uvicorn, "Server", Recorded)
    sock = server_module.bind("127.0.0.1", 0)
    llm = graphkiln.load(artifact, kv_cache_tokens=2048)
    llm.wait_ready()  # its background preparation, which runs under the load's own interval, is done
    before = sys.getswitchinterval()
    thread = threading.Thread(target=server_module.serve, args=(llm, ServerConfig("tiny"), sock, "warning", 2e-4))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not (started and started[0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.02)
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        client = Server(f"http://127.0.0.1:{sock.getsockname()[1]}", None).client()
        assert client.completions.create(model="tiny", prompt="If the file", max_tokens=4).choices[0].text
    finally:
        if started:
            started[0].should_exit = True
        thread.join(30)
    assert not thread.is_alive() and sys.getswitchinterval() == pytest.approx(before)
