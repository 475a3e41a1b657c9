"""A real server on the tiny model for the whole session (API key on, asynchronous scheduling on), the official
openai client on it, and an offline LLM on the same model to compare against. The servers run twice: the engine in
a thread of the server's process, then in a process of its own (serve's default), so every test over them checks
both."""

from __future__ import annotations

import openai
import pytest
from helpers.http_server import API_KEY, start_server, wait_idle

from deltaserve import LLM

ENGINE_PLACES = ["thread", "process"]


@pytest.fixture(scope="session", params=ENGINE_PLACES)
def server(request, tiny_model):
    """Asynchronous scheduling on, as on a GPU by default (one step in flight while the next is scheduled): the
    tests that compare with offline_llm (synchronous) check that it changes no token; small_server runs without."""
    srv = start_server(tiny_model, max_model_len=512, async_scheduling=True, engine_process=request.param == "process")
    assert srv.engine.async_scheduling
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def thread_server(tiny_model):
    """The engine in a thread of this process, for tests that hold its steps."""
    srv = start_server(tiny_model, max_model_len=512)
    yield srv
    srv.stop()


@pytest.fixture
def http(server):
    """An httpx client with the key; at teardown the server must be idle with its whole cache free."""
    with server.http() as client:
        yield client
        wait_idle(client)


@pytest.fixture
def client(server, http):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def async_client(server, http):
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def offline_llm(tiny_model):
    return LLM(str(tiny_model), device="cpu", max_model_len=512, threads=1)


@pytest.fixture(scope="session", params=ENGINE_PLACES)
def small_server(request, tiny_model):
    """A server that fills up fast: 2 running + 1 waiting request at most, 64-token context."""
    srv = start_server(tiny_model, max_model_len=64, max_num_seqs=2, max_queue=1,
                       engine_process=request.param == "process")
    yield srv
    srv.stop()
