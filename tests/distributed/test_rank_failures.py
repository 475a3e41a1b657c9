"""Tensor parallel on the CPU when a process ends early: `deltaserve generate --tensor-parallel-size 2` is run in a
session of its own, its spawned worker is killed (or the whole group gets Ctrl-C), and the command must end at
once with one line on stderr, never a traceback nor a wait for gloo's timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from deltaserve.distributed import ParallelConfig
from deltaserve.entrypoints.llm import LLM

WAIT_S = 60  # far above the seconds each run takes: reaching it means a hang


def _start(model: Path, max_tokens: int) -> subprocess.Popen:
    argv = ["deltaserve", "generate", "--model", str(model), "--prompt", "And he said", "--max-tokens",
            str(max_tokens), "--ignore-eos", "--tensor-parallel-size", "2", "--threads", "1", "--max-model-len", "4096"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _worker_pid(rank0: subprocess.Popen) -> int:
    """The process rank 0 spawned for rank 1 (multiprocessing's spawn_main), once it exists."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and rank0.poll() is None:
        children = Path(f"/proc/{rank0.pid}/task/{rank0.pid}/children").read_text().split()
        for pid in children:
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except FileNotFoundError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"rank 0 spawned no worker (exit code {rank0.poll()})")


def _wait_for_line(rank0: subprocess.Popen, text: str) -> None:
    """Reads rank 0's stderr until a line holding text (rank 0 has then built its engine)."""
    for line in rank0.stderr:
        if text in line:
            return
    raise AssertionError(f"rank 0 ended (exit code {rank0.wait()}) before printing {text!r}")


def _finish(rank0: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = rank0.communicate(timeout=WAIT_S)
    finally:
        if rank0.poll() is None:
            os.killpg(rank0.pid, signal.SIGKILL)
    assert "Traceback" not in err, err
    return rank0.returncode, err


def _gone(pid: int) -> bool:
    """The worker has exited (reaped by rank 0, or a zombie left to init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_worker_killed_during_start_up_ends_rank_0_with_one_line(tiny_model):
    rank0 = _start(tiny_model, 8)
    os.kill(_worker_pid(rank0), signal.SIGKILL)  # it is still importing torch: the group has not formed yet
    code, err = _finish(rank0)
    assert code == 1
    assert err.strip().splitlines()[-1] == "error: rank 1 exited with code -9 (SIGKILL) during start-up"


def test_a_bad_checkpoint_under_tensor_parallel_is_rank_0s_own_error(tiny_model, tmp_path):
    """Every rank reads the checkpoint and fails on it: rank 0's error (exit 2) is told, not "rank 1 exited"."""
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    path = next(bad.glob("*.safetensors"))
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    name = next(n for n, entry in header.items() if n != "__metadata__" and entry["dtype"] == "F32")
    header[name]["dtype"] = "I32"  # same bytes and shape: only the dtype check refuses it
    path.write_bytes(data[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(size) + data[8 + size:])
    code, err = _finish(_start(bad, 2))
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: ") and "I32" in err.splitlines()[-1]


def test_a_worker_killed_while_running_is_named(tiny_model):
    rank0 = _start(tiny_model, 3000)
    worker = _worker_pid(rank0)
    _wait_for_line(rank0, "start-up: cache allocation")
    os.kill(worker, signal.SIGKILL)
    code, err = _finish(rank0)
    assert code == 1
    assert err.strip().splitlines()[-1] == "error: rank 1 exited with code -9 (SIGKILL) while running"


@pytest.mark.parametrize("when", ["start-up", "running"])
def test_ctrl_c_to_the_group_exits_130_quietly_and_ends_the_worker(tiny_model, when):
    rank0 = _start(tiny_model, 3000)
    worker = _worker_pid(rank0)
    if when == "running":
        _wait_for_line(rank0, "start-up: cache allocation")
    else:  # past the milliseconds in which rank 0 ignores Ctrl-C while it starts the worker (_spawn_workers)
        time.sleep(0.3)
    os.killpg(rank0.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: every process of the group gets it
    code, err = _finish(rank0)
    assert code == 130
    assert "error" not in err and "KeyboardInterrupt" not in err, err
    assert _gone(worker)


def test_sigterm_to_rank_0_ends_the_worker_quietly(tiny_model):
    rank0 = _start(tiny_model, 3000)
    worker = _worker_pid(rank0)
    _wait_for_line(rank0, "start-up: cache allocation")
    rank0.send_signal(signal.SIGTERM)
    code, err = _finish(rank0)
    assert code == -signal.SIGTERM
    deadline = time.monotonic() + WAIT_S
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker)
    assert "error" not in err, err  # the worker's stderr is rank 0's: its gloo error would be here


def test_several_launched_processes_without_tensor_parallel_are_refused(tiny_model, monkeypatch, capsys):
    """By the command line, where each process would print the whole job's output; the Python API lets a
    data-parallel job (WORLD_SIZE ranks, each its own LLM) be."""
    from deltaserve.entrypoints.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 sets it: each would run the whole job
    assert main(["generate", "--model", str(tiny_model), "--max-tokens", "2", "--threads", "1"]) == 2
    assert "pass --tensor-parallel-size 2" in capsys.readouterr().err
    with LLM(tiny_model, threads=1) as llm:
        assert llm.generate([{"prompt_token_ids": [1, 2]}], use_tqdm=False)[0].outputs


def test_a_worker_says_its_own_error_in_one_line_and_nothing_when_rank_0_went_away(capsys):
    from deltaserve.core.tensor_parallel import _exit_worker

    for error, said in [(RuntimeError("shard\nmissing"), "error: rank 1: RuntimeError: shard missing\n"),
                        (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"), "")]:
        with pytest.raises(SystemExit) as exited:
            _exit_worker(1, error)
        assert exited.value.code == 1
        assert capsys.readouterr().err == said


def test_steps_travel_over_a_gloo_group_of_their_own_with_a_long_timeout():
    """An idle server's workers wait in broadcast_object for the next step: on GPUs NCCL's watchdog would end that
    wait after 10 minutes, so the objects go over gloo whatever the default group's backend."""
    import torch.distributed as dist

    from deltaserve import distributed

    distributed.init_process_group(ParallelConfig(0, 1), dist.HashStore(), "cpu")
    try:
        group = distributed._objects_group
        assert group is not None and group is not dist.group.WORLD
        assert dist.get_backend(group) == "gloo"
        assert distributed.broadcast_object({"step": 1}, ParallelConfig(0, 2)) == {"step": 1}  # rank 0's own
    finally:
        dist.destroy_process_group()
        distributed._objects_group = None


def _sleepers(count: int) -> list:
    import multiprocessing

    workers = [multiprocessing.get_context("fork").Process(target=time.sleep, args=(WAIT_S,), daemon=True)
               for _ in range(count)]
    for worker in workers:
        worker.start()
    return workers


def _until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_step_that_waits_on_a_dead_rank_ends_the_process(capsys):
    """NCCL's collective would wait for the dead rank until its watchdog, ten minutes: a wait on the group still
    going stuck_s after the death ends the process in one line, and the other workers with it."""
    from deltaserve.core.tensor_parallel import GroupWatch

    workers, ended = _sleepers(2), []
    watch = GroupWatch(workers, stuck_s=0.3, end_process=ended.append)
    with watch.waiting():  # a step stuck in a collective
        os.kill(workers[1].pid, signal.SIGKILL)
        _until(lambda: ended)
    assert ended == [1]
    assert capsys.readouterr().err == ("error: rank 2 exited with code -9 (SIGKILL) while running; rank 0 waited 0 s "
                                       "on the group for it, so this process ends\n")
    workers[0].join(WAIT_S)
    assert workers[0].exitcode == -signal.SIGKILL
    watch.stop()


def test_a_dead_rank_fails_the_next_step_and_leaves_an_idle_engine_running(capsys):
    from deltaserve.core.tensor_parallel import GroupWatch, RankError

    workers, ended = _sleepers(2), []
    watch = GroupWatch(workers, stuck_s=0.2, end_process=ended.append)
    os.kill(workers[0].pid, signal.SIGKILL)
    assert watch.failed.wait(WAIT_S)
    with pytest.raises(RankError, match=r"^rank 1 exited with code -9 \(SIGKILL\) while running$"):
        with watch.waiting():
            pytest.fail("a step ran on a group with a dead rank")
    time.sleep(0.5)  # past stuck_s: no step waits, so the process goes on
    assert ended == [] and capsys.readouterr().err == ""
    watch.stop()
    workers[1].kill()
    workers[1].join(WAIT_S)


def test_exits_rank_0_causes_are_not_an_error():
    from deltaserve.core.tensor_parallel import GroupWatch

    [worker] = _sleepers(1)
    watch = GroupWatch([worker], stuck_s=0.2, end_process=pytest.fail)
    watch.expect_exits()
    worker.kill()
    worker.join(WAIT_S)
    assert not watch.failed.wait(0.5) and watch.error is None
    watch.stop()


def test_the_watch_and_rank_0_reap_a_dead_worker_together_without_losing_its_exit_code():
    """Two threads joining one process could both miss its exit code (a TypeError in place of the RankError)."""
    from deltaserve.core.tensor_parallel import GroupWatch, RankError, abort_group

    for _ in range(20):
        workers = _sleepers(2)
        watch = GroupWatch(workers, stuck_s=WAIT_S, end_process=pytest.fail)
        os.kill(workers[1].pid, signal.SIGKILL)
        with pytest.raises(RankError, match=r"^rank 2 exited with code -9 \(SIGKILL\) while running$"):
            abort_group(workers, None, "while running")
        _until(lambda: watch.failed.is_set() or not watch._thread.is_alive())
        assert watch.error is None or str(watch.error) == "rank 2 exited with code -9 (SIGKILL) while running"
        watch.stop()


@pytest.mark.slow
@pytest.mark.parametrize("busy", [False, True])
def test_a_server_whose_worker_died_answers_503(tiny_model, tmp_path, busy):
    """Idle when the worker dies: /health turns 503 and a request is refused, without a step sent to the dead rank;
    busy: the request in flight fails with 503 too, and the log says why in one line."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        ["deltaserve", "serve", "--model", str(tiny_model), "--port", str(port), "--served-model-name", "tiny",
         "--tensor-parallel-size", "2", "--threads", "1", "--max-model-len", "512"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        worker = _worker_pid(server)
        deadline = time.monotonic() + WAIT_S
        while _status(f"{base}/health") != 200:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=WAIT_S).status_code == 200
        in_flight = []
        if busy:
            long = {**body, "max_tokens": 400, "ignore_eos": True}
            thread = threading.Thread(target=lambda: in_flight.append(
                httpx.post(f"{base}/v1/completions", json=long, timeout=WAIT_S).status_code))
            thread.start()
            time.sleep(1.0)
        os.kill(worker, signal.SIGKILL)
        if busy:
            thread.join(WAIT_S)
            assert in_flight == [503]
        while _status(f"{base}/health") != 503:
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=WAIT_S)
        assert response.status_code == 503, response.text
        server.send_signal(signal.SIGTERM)
        server.wait(WAIT_S)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in text, text
    if busy:
        assert "the engine's loop ended: rank 1 exited with code -9 (SIGKILL) while running" in text, text


def _status(url: str) -> int | None:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None
