"""What `orchestrate run --model WHOLE.gguf` ships, before any transfer: the stage image it streams is byte
for byte the file `orchestrate split` writes, the vocabulary image reads as the model (a model that fits no node:
tests/ray/test_cli_runs.py)."""

import os
from pathlib import Path

from conftest import PROMPTS


def test_the_stage_image_is_the_split_file_and_the_vocabulary_image_reads_as_the_model(smollm2, splits, tmp_path):
    from stages.tokenizer import Tokenizer
    from stages.gguf_file import read_model
    from stages.split import plan_split, stage_file_image
    from stages.stage_image import vocabulary_image, write_atomically

    model = read_model(smollm2)
    plan = plan_split(model, 3, [10, 20])
    for index, split_file in enumerate(splits[3]):
        image = stage_file_image(plan, index)
        expected = Path(split_file).read_bytes()
        assert image.size == len(expected) and b"".join(image.chunks()) == expected
        assert b"".join(image.chunks(len(image.header) + 12345)) == expected[len(image.header) + 12345:]
    vocabulary = tmp_path / "vocabulary.gguf"
    write_atomically(vocabulary_image(model), vocabulary)
    assert os.path.getsize(vocabulary) < 4 * 1024**2
    assert Tokenizer(str(vocabulary)).vocabulary_digest() == Tokenizer(smollm2).vocabulary_digest()
    assert Tokenizer(str(vocabulary)).chat_prompt(PROMPTS[0]) == Tokenizer(smollm2).chat_prompt(PROMPTS[0])
