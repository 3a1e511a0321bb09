"""The built wheel works on its own (SPEC §2): build it, install it into a fresh venv, use it.

The check runs in the fresh venv with ``python -I`` from a temporary working directory, so neither
the source tree nor the dev venv can leak in: the Lua scripts must come from the installed package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.servers import ServerProcess

# What this checks does not depend on the server: `make test` runs it in its first pass only.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parent.parent

CHECK_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import sys
    from importlib import resources
    from pathlib import Path

    import redis.asyncio as aioredis

    import redis_locks_async
    from redis_locks_async import Lock

    url, name, source_root = sys.argv[1:4]
    package_dir = Path(redis_locks_async.__file__).resolve().parent
    prefix = Path(sys.prefix).resolve()
    assert package_dir.is_relative_to(prefix), f"imported from {package_dir}, not {prefix}"
    assert not any(
        Path(entry or ".").resolve() == Path(source_root) for entry in sys.path
    ), "source tree on sys.path"
    lua_dir = resources.files("redis_locks_async").joinpath("lua")
    names = sorted(p.name for p in lua_dir.iterdir() if p.name.endswith(".lua"))
    assert Path(str(lua_dir)).resolve().is_relative_to(prefix), f"lua read from {lua_dir}"
    print("LUA", *names)


    async def main() -> None:
        client = aioredis.Redis.from_url(url)
        try:
            async with Lock(client, name) as lease:
                token = lease.fencing_token
                assert isinstance(token, int), repr(token)
                print("TOKEN", token)
        finally:
            await client.aclose()


    asyncio.run(main())
    """
)


def _run(argv: list[str], *, cwd: Path, timeout: float = 240) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(argv)} failed ({proc.returncode})\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installs_and_locks(tmp_path: Path, server: ServerProcess, name: str) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)], cwd=ROOT)
    (wheel,) = dist.glob("redis_locks_async-*.whl")

    source_lua = sorted(p.name for p in (ROOT / "lua").glob("*.lua"))
    assert source_lua, "no Lua scripts in lua/"
    with zipfile.ZipFile(wheel) as zf:
        members = set(zf.namelist())
    for script in source_lua:
        assert f"redis_locks_async/lua/{script}" in members
    assert "redis_locks_async/py.typed" in members
    assert "redis_locks_async/__init__.py" in members

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], cwd=tmp_path)
    assert (venv / "bin" / "redis-locks").is_file(), "console script not installed"

    work = tmp_path / "work"
    work.mkdir()
    (work / "check.py").write_text(CHECK_SCRIPT)
    out = _run([str(python), "-I", "check.py", server.url, name, str(ROOT)], cwd=work)

    fields: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        fields[key] = value
    assert fields["LUA"].split() == source_lua
    assert int(fields["TOKEN"]) >= 0
