import shutil

import pytest

from deltaserve.tokenizer import load_tokenizer
from deltaserve.tokenizer.train import train_tiny_tokenizer


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(folder, ids) of one tiny tokenizer, trained once for the whole session."""
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    return folder, train_tiny_tokenizer(folder, 1024)


@pytest.fixture(scope="session")
def tokenizer(trained):
    return load_tokenizer(trained[0])


@pytest.fixture
def model_dir(trained, tmp_path):
    """A fresh copy of the tiny tokenizer's folder that a test may break."""
    shutil.copytree(trained[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture(scope="session")
def byte_ids(tokenizer) -> dict[int, int]:
    """byte value -> the id of the token that is exactly that one byte."""
    ids = {}
    for token_id in range(tokenizer.vocab_size):
        token_bytes = tokenizer.id_to_bytes(token_id)
        if len(token_bytes) == 1 and token_id not in tokenizer.all_special_ids:
            ids[token_bytes[0]] = token_id
    return ids
