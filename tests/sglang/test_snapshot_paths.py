"""Snapshot paths stay inside the snapshot directory; admin routes without a key answer loopback
clients only (no engine needed: the route handlers run on a hand-made request)."""

import asyncio
import os

import pytest

from rhyme_sglang.core import DraftStore
from rhyme_sglang.sglang_ext.snapshot_paths import confine

SECRET = b"SECRET-CONTENT-4242"


@pytest.fixture()
def root(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir()
    (tmp_path / "outside.txt").write_bytes(SECRET)
    return d


def test_relative_path_resolves_inside(root):
    assert confine("h.snap", str(root)) == str(root.resolve() / "h.snap")
    assert confine(str(root / "h.snap"), str(root)) == str(root.resolve() / "h.snap")


@pytest.mark.parametrize("path", ["../outside.txt", "a/../../outside.txt", "/etc/hostname",
                                  "/proc/self/environ", ".", "", "x\x00y"])
def test_paths_leaving_the_directory_are_refused(root, path):
    with pytest.raises(ValueError) as err:
        confine(path, str(root), must_exist=True)
    assert SECRET.decode() not in str(err.value)


def test_symlink_out_is_refused(root):
    os.symlink(root.parent / "outside.txt", root / "link.snap")
    os.symlink(root.parent, root / "up")
    for path in ("link.snap", "up/outside.txt", "up/new.snap"):
        with pytest.raises(ValueError, match="outside the snapshot directory"):
            confine(path, str(root))


def test_non_snapshot_file_inside_is_refused_without_its_bytes(root):
    (root / "junk.snap").write_bytes(SECRET)
    with pytest.raises(ValueError) as err:
        confine("junk.snap", str(root), must_exist=True)
    assert "not a draft-store snapshot" in str(err.value)
    assert "SECRET" not in str(err.value) and "4242" not in str(err.value)
    with pytest.raises(ValueError) as err:  # the store's own check echoes no bytes either
        DraftStore().load(str(root / "junk.snap"))
    assert "SECRET" not in str(err.value)


def test_real_snapshot_inside_is_accepted(root):
    s = DraftStore()
    s.add_response("p", [1, 2], [3, 4], 0)
    s.save(str(root / "ok.snap"))
    assert confine("ok.snap", str(root), must_exist=True).endswith("ok.snap")


def test_default_snapshot_dir_is_under_the_user_cache(monkeypatch, tmp_path):
    from rhyme_sglang.sglang_ext.config import RhymeConfig

    monkeypatch.setenv("RHYME_CACHE_DIR", str(tmp_path / "cache"))
    assert RhymeConfig().snapshot_root() == str(tmp_path / "cache" / "snapshots")
    assert RhymeConfig(snapshot_dir="~/x").snapshot_root() == os.path.expanduser("~/x")


class _Client:
    """Records control calls (a hand-written fake of ControlClient)."""

    def __init__(self):
        self.calls = []

    def call(self, cmd, **args):
        self.calls.append((cmd, args))
        return {"ok": cmd}


def _request(method, path, host, body=b""):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b"", "client": (host, 5555) if host else None}
    return Request(scope, receive)


def _routes(root, keyless, rhyme=True):
    pytest.importorskip("starlette")
    from rhyme_sglang.sglang_ext.http_api import make_routes

    client = _Client()
    return client, make_routes(client, str(root), keyless_admin=keyless, rhyme=rhyme)


def test_a_server_without_rhyme_serves_only_the_breakdown(root):
    client, routes = _routes(root, keyless=True, rhyme=False)
    for (method, path, _), handler in routes.items():
        resp = asyncio.run(handler(_request(method, path, "127.0.0.1", b"{}")))
        assert resp.status_code == (200 if path == "/rhyme/breakdown" else 404), path
    assert client.calls == [("breakdown", {}), ("breakdown", {})]
    post = routes[("POST", "/rhyme/breakdown", True)]
    resp = asyncio.run(post(_request("POST", "/rhyme/breakdown", "127.0.0.1", b'{"reset": true}')))
    assert resp.status_code == 200 and client.calls[-1] == ("breakdown", {"reset": True})
    resp = asyncio.run(post(_request("POST", "/rhyme/breakdown", "127.0.0.1", b'{"window": 1}')))
    assert resp.status_code == 400 and len(client.calls) == 3
    resp = asyncio.run(post(_request("POST", "/rhyme/breakdown", "10.1.2.3", b'{"reset": true}')))
    assert resp.status_code == 403 and len(client.calls) == 3  # resetting is an admin call


def test_breakdown_reset_must_be_a_boolean():
    from rhyme_sglang.sglang_ext import timeline

    assert "decode" in timeline.breakdown(reset=False)
    with pytest.raises(ValueError, match="reset must be a boolean"):
        timeline.breakdown(reset="yes")


@pytest.mark.parametrize("host", ["10.1.2.3", "192.168.0.7", None])
def test_keyless_admin_routes_refuse_remote_clients(root, host):
    client, routes = _routes(root, keyless=True)
    admin = [(m, p) for (m, p, a) in routes if a]
    assert {p for _, p in admin} >= {"/rhyme/save", "/rhyme/load", "/rhyme/reset",
                                      "/rhyme/rewards", "/rhyme/advance_epoch",
                                      "/rhyme/history", "/rhyme/schedule_policy"}
    for method, path in admin:
        resp = asyncio.run(routes[(method, path, True)](_request(method, path, host, b"{}")))
        assert resp.status_code == 403, path
    assert client.calls == []
    resp = asyncio.run(routes[("GET", "/rhyme/stats", False)](_request("GET", "/rhyme/stats", host)))
    assert resp.status_code == 200 and client.calls == [("stats", {})]


def test_loopback_and_keyed_admin_calls_pass_with_confined_paths(root):
    client, routes = _routes(root, keyless=True)
    save = routes[("POST", "/rhyme/save", True)]
    resp = asyncio.run(save(_request("POST", "/rhyme/save", "127.0.0.1", b'{"path": "a.snap"}')))
    assert resp.status_code == 200
    assert client.calls == [("save", {"path": str(root.resolve() / "a.snap")})]
    resp = asyncio.run(save(_request("POST", "/rhyme/save", "127.0.0.1",
                                     b'{"path": "../evil.snap"}')))
    assert resp.status_code == 400 and len(client.calls) == 1
    _, keyed = _routes(root, keyless=False)  # with a key, sglang's auth decides; no host check
    resp = asyncio.run(keyed[("POST", "/rhyme/reset", True)](
        _request("POST", "/rhyme/reset", "10.1.2.3", b"{}")))
    assert resp.status_code == 200


@pytest.mark.parametrize("host, keyless, warns", [
    ("0.0.0.0", True, True), ("10.0.0.4", True, True), ("::", True, True),
    ("127.0.0.1", True, False), ("localhost", True, False), ("::1", True, False),
    ("0.0.0.0", False, False),
])
def test_start_warns_when_admin_routes_face_the_network_without_a_key(host, keyless, warns):
    pytest.importorskip("starlette")
    from rhyme_sglang.launch_server import exposure_warning

    msg = exposure_warning(host, keyless)
    assert (msg is not None) == warns
    if warns:
        assert host in msg and "--admin-api-key" in msg
