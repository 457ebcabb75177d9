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
