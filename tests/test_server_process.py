"""ServerProcess.stop: ends the process group, and a second call (or a group already gone)
does nothing, so fixtures can stop servers early and again at teardown."""

from rhyme_sglang.server_process import ServerProcess


class _Sleeper(ServerProcess):
    module = "http.server"  # any long-running module: stop() must end it

    def base_args(self) -> list[str]:
        return ["--bind", "127.0.0.1", str(self.port)]


def test_stop_ends_the_process_and_a_second_stop_does_nothing(tmp_path):
    proc = _Sleeper([], str(tmp_path / "log"))
    proc.stop()
    assert proc.proc.poll() is not None
    proc.stop()  # already stopped: no ProcessLookupError


def test_stop_after_the_process_exited_on_its_own(tmp_path):
    proc = _Sleeper([], str(tmp_path / "log"))
    proc.proc.kill()
    proc.proc.wait()
    proc.stop()
    proc.stop()


class _HttpServer(_Sleeper):
    def ready(self) -> bool:  # http.server has no /health: any answer means it is listening
        import urllib.request

        try:
            urllib.request.urlopen(self.url + "/", timeout=2)
        except Exception as exc:  # noqa: BLE001 - a 404 still means it listens
            return getattr(exc, "code", None) is not None
        return True


def test_a_launch_whose_port_was_taken_restarts_on_another_port(tmp_path, monkeypatch):
    import socket

    from rhyme_sglang import server_process

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    free = server_process._free_port
    monkeypatch.setattr(server_process, "_free_port", lambda: ports.pop() if ports else free())
    proc = _HttpServer([], str(tmp_path / "log"))
    try:
        first = proc.port
        proc.wait_ready(timeout=60)
        assert proc.port != first and proc.ready()
        assert "address already in use" in (tmp_path / "log").read_text().lower()
    finally:
        proc.stop()
        taken.close()
