"""The fork server's children behave as new interpreters for what the suite's tests read from them
(tests/forked_python.py): arguments, environment, working directory, import path, streams, exit status, timeout;
torchrun's agent and workers too."""

import os
import signal
import subprocess
import sys

import forked_python
import pytest
from subprocess_env import child_env

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_PROBE"),
                  "path0": sys.path[0], "on_path": "/nowhere/extra" in sys.path, "stdin": sys.stdin.read(),
                  "main": __name__, "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


class _OnlyForked:
    """``subprocess.Popen`` that always forks: a test here never passes through a real interpreter."""

    def __new__(cls, args, **kwargs):
        return forked_python.ForkedPopen(args, **kwargs)


def forked(*args, **kwargs) -> subprocess.CompletedProcess:
    from unittest import mock

    with mock.patch.object(subprocess, "Popen", _OnlyForked):
        return subprocess.run([sys.executable, *args], **kwargs)


def popen(*args, **kwargs) -> forked_python.ForkedPopen:
    return forked_python.ForkedPopen([sys.executable, *args], **kwargs)


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_child_sees_its_own_arguments_environment_folder_path_and_stdin(tmp_path, code):
    import json

    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = child_env({"FORKED_PROBE": "yes"}, path=("/nowhere/extra",))
    done = forked(str(script), "a b", str(code), env=env, cwd=tmp_path, capture_output=True, text=True,
                  input="fed", timeout=60)
    assert done.returncode == code, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"argv": [str(script), "a b", str(code)], "cwd": str(tmp_path), "env": "yes",
                    "path0": str(tmp_path), "on_path": True, "stdin": "fed", "main": "__main__", "torch": True,
                    "dynamo": False}
    assert done.stderr == "to stderr\n"


def test_c_code_and_m_modules_run_as_main_and_an_uncaught_error_exits_1_with_its_traceback(tmp_path):
    done = forked("-c", "import sys; print(__name__, sys.argv); raise ValueError('boom')", "x", env=child_env(),
                  capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "__main__ ['-c', 'x']\n"
    assert done.stderr.rstrip().endswith("ValueError: boom") and "Traceback" in done.stderr
    (tmp_path / "probe_module.py").write_text("import sys; print(__name__, sys.argv[1:])")
    done = forked("-m", "probe_module", "y", env=child_env(path=(str(tmp_path),)), capture_output=True, text=True,
                  timeout=60)
    assert (done.returncode, done.stdout) == (0, "__main__ ['y']\n"), done.stderr


def test_atexit_handlers_run_and_a_timeout_kills_the_child(tmp_path):
    done = forked("-c", "import atexit; atexit.register(print, 'bye')", env=child_env(), capture_output=True,
                  text=True, timeout=60)
    assert done.stdout == "bye\n"
    with pytest.raises(subprocess.TimeoutExpired):
        forked("-c", "import time; time.sleep(60)", env=child_env(), capture_output=True, timeout=1)
    done = forked("-c", "print('served after a timeout')", env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.stdout == "served after a timeout\n"


def test_what_it_cannot_serve_goes_to_a_real_interpreter(monkeypatch):
    for args, kwargs in [
        ([sys.executable, "-X", "importtime", "-c", "pass"], {}),  # interpreter options
        ([sys.executable, "-m", "pytest", "--version"], {}),  # pytest
        ([sys.executable, "-c", "pass"], {"preexec_fn": os.getpid}),  # what a fork cannot honour
        (["true"], {}),  # not Python
    ]:
        with forked_python.RoutingPopen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs) as p:
            assert type(p) is forked_python.RoutingPopen and p.wait(60) == 0
    with forked_python.RoutingPopen([sys.executable, "-c", "pass"]) as p:
        assert type(p) is forked_python.ForkedPopen and p.wait(60) == 0
    monkeypatch.setattr(forked_python, "ENABLED", False)  # a test marked fresh_interpreter
    with forked_python.RoutingPopen([sys.executable, "-c", "pass"]) as p:
        assert type(p) is forked_python.RoutingPopen and p.wait(60) == 0


NESTED_PROBE = """
import os, subprocess, sys
grandchild = "import os, sys; print(os.getppid()); print('to stderr', file=sys.stderr); sys.exit(4)"
done = subprocess.run([sys.executable, "-c", grandchild], capture_output=True, text=True, timeout=60)
print(os.getpid(), done.stdout.strip(), done.returncode, done.stderr.strip() == "to stderr")
"""


@pytest.mark.parametrize("variable", ["", "0"])
def test_a_forked_childs_own_python_children_are_forked_by_the_server_unless_the_variable_says_0(variable):
    env = child_env({"TESTS_FORKED_PYTHON": variable} if variable else {})
    done = forked("-c", NESTED_PROBE, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    child, parent_of_grandchild, status, streamed = done.stdout.split()
    assert (status, streamed) == ("4", "True")  # its exit status and streams come back either way
    # forked by the server (not the child's child) unless the child's environment turns the forking off
    assert (parent_of_grandchild == child) == (variable == "0")


TRANSFORMERS_PROBE = """
import sys
loaded = "transformers.models.llama.modeling_llama" in sys.modules
utils = sys.modules.get("transformers.utils.import_utils")
print(loaded, loaded and utils.is_torch_npu_available.cache_info().currsize, "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("with_transformers", [False, True])
def test_a_module_whose_children_import_transformers_gets_them_from_a_server_that_did_with_its_answers_cleared(
        monkeypatch, with_transformers):
    monkeypatch.setattr(forked_python, "ALSO_IMPORTED",  # children_import("transformers")
                        forked_python.CHILDREN_IMPORT["transformers"] if with_transformers else ())
    done = forked("-c", TRANSFORMERS_PROBE, env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # the machine's answers (is_torch_npu_available, ...) are asked again in the child, as after a new import
    assert done.stdout.split() == (["True", "0", "True"] if with_transformers else ["False", "False", "False"])


def test_children_run_side_by_side_streaming_their_output_and_taking_signals(tmp_path):
    code = "import sys, time; print('up', flush=True); sys.stdin.readline(); time.sleep(60)"
    first, second = (popen("-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2))
    assert first.stdout.readline() == "up\n" and second.stdout.readline() == "up\n"  # both running at once
    assert first.poll() is None and second.poll() is None
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        second.wait(0.2)
    second.kill()
    assert second.wait(30) == -signal.SIGKILL and second.pid != first.pid
    for p in (first, second):
        p.stdin.close(), p.stdout.close()
    log = tmp_path / "log"
    with open(log, "w") as f:  # a file, stderr into stdout, no stdin
        code = "import sys; print('out'); print('err', file=sys.stderr); print(repr(sys.stdin.read()))"
        assert popen("-c", code, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT).wait(60) == 0
    assert log.read_text().split() == ["out", "err", "''"]
    done = forked("-c", "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])", input=b"abc\r\n",
                  capture_output=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"\n\rcba", b"")  # bytes untouched


WORKER = """
import json, os, sys
forked = "torch" in sys.modules  # a new interpreter has not imported torch yet
import torch.distributed as dist
dist.init_process_group("gloo")
gathered = [None, None]
dist.all_gather_object(gathered, os.environ["LOCAL_RANK"])
elastic = any(m.startswith("torch.distributed.elastic") for m in sys.modules)
print(json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "gathered": gathered,
                  "argv": sys.argv[1:], "forked": forked, "parent": os.getppid(),
                  "session": os.getsid(0) == os.getpid(), "unbuffered": sys.stdout.line_buffering,
                  "elastic": elastic}))
dist.destroy_process_group()
sys.exit(int(os.environ["RANK"]) * int(sys.argv[-1]))
"""


@pytest.mark.parametrize("code", [0, 5])
def test_torchrun_and_its_workers_are_forked_and_behave_as_torchrun_s(tmp_path, code):
    import json

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = forked("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), "x",
                  str(code), env=child_env({"OMP_NUM_THREADS": "1"}), cwd=tmp_path, capture_output=True, text=True,
                  timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(line["rank"] for line in lines) == ["0", "1"], done.stdout + done.stderr
    for line in lines:  # a rendezvous, a collective, the agent's children in sessions of their own, `python -u`
        assert line["world"] == "2" and line["gathered"] == ["0", "1"] and line["argv"] == ["x", str(code)]
        assert line["forked"] and line["session"] and line["unbuffered"] and not line["elastic"]
    assert lines[0]["parent"] == lines[1]["parent"] != os.getpid()
    if code:  # a worker's failure is torchrun's: its exit status and its report naming the rank
        assert done.returncode == 1 and "ChildFailedError" in done.stderr and "exitcode  : 5" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
