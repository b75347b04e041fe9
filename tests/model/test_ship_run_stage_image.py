"""What `orchestrate run --model WHOLE.gguf` ships, before any transfer: the stage image it streams is byte
for byte the file `orchestrate split` writes, the vocabulary image reads as the model; and a model that fits
no node is refused with the numbers."""

import os
from pathlib import Path

from conftest import PROMPTS, orchestrate


def test_a_model_that_fits_no_node_is_refused_with_the_numbers(smollm2):
    """A context whose KV cache cannot fit this machine's memory, split or not."""
    result = orchestrate("run", "--model", smollm2, "--stages", "2", "--n-ctx", str(1 << 24), "--max-tokens", "1")
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "fits no split over 2 node(s)" in line
    assert "MiB in all" in line and "Traceback" not in result.stderr


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
