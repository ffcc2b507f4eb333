"""Tests for jlp.data.text: BERT's WordPiece tokenizer, the GLUE TSV loader, digits as tokens.

References: the expected tokenizations of google-research/bert `tokenization_test.py` (written out
here), sklearn's load_digits pixel values for digits_tokens, and small TSV files written by the
tests with their ids worked out by hand.
"""

import numpy as np
import pytest
from sklearn.datasets import load_digits

from jlp.data import DATASETS, get_dataset
from jlp.data import digits as digits_lib
from jlp.data import text

# google-research/bert tokenization_test.py: test_wordpiece_tokenizer / test_full_tokenizer.
BERT_TEST_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "want", "##want", "##ed", "wa", "un",
                   "runn", "##ing", ",", "low", "lowest"]


def test_basic_tokenizer_matches_berts_tests():
  lower = text.WordPiece(BERT_TEST_VOCAB, lowercase=True)
  cased = text.WordPiece(BERT_TEST_VOCAB, lowercase=False)
  assert lower.basic_tokens(" \tHeLLo!how  \n Are yoU?  ") == ["hello", "!", "how", "are", "you",
                                                               "?"]
  assert lower.basic_tokens("H\u00E9llo") == ["hello"]  # accents stripped when lower-casing
  assert cased.basic_tokens(" \tHeLLo!how  \n Are yoU?  ") == ["HeLLo", "!", "how", "Are", "yoU",
                                                               "?"]
  assert cased.basic_tokens("ah\u535A\u63A8zz") == ["ah", "\u535A", "\u63A8", "zz"]  # CJK split
  assert cased.basic_tokens("a\x00b\ufffdc\x07d") == ["abcd"]  # NUL, U+FFFD, controls dropped


def test_wordpiece_is_greedy_longest_match_first():
  tok = text.WordPiece(BERT_TEST_VOCAB)
  assert tok.tokenize("") == []
  assert tok.tokenize("unwanted running") == ["un", "##want", "##ed", "runn", "##ing"]
  assert tok.tokenize("unwantedX running") == ["[UNK]", "runn", "##ing"]
  assert tok.tokenize("UNwant\u00E9d,running") == ["un", "##want", "##ed", ",", "runn", "##ing"]
  assert tok.word_pieces("lowest") == ["lowest"]  # longest match, not "low" + ...
  assert tok.word_pieces("w" * (text.MAX_WORD_CHARS + 1)) == ["[UNK]"]


def test_encode_adds_cls_sep_and_pads_or_cuts():
  tok = text.WordPiece(BERT_TEST_VOCAB)
  # [CLS]=2 un=8 ##want=5 ##ed=6 runn=9 ##ing=10 [SEP]=3 [PAD]=0
  np.testing.assert_array_equal(tok.encode("unwanted running", 10), [2, 8, 5, 6, 9, 10, 3, 0, 0, 0])
  np.testing.assert_array_equal(tok.encode("unwanted running", 5), [2, 8, 5, 6, 3])
  assert tok.encode("x", 4).dtype == np.int32
  with pytest.raises(ValueError, match="max_len=1 is not allowed"):
    tok.encode("x", 1)
  with pytest.raises(ValueError, match="vocab=.*is not allowed"):
    text.WordPiece(["want", "[UNK]"])


def _write_glue(root, train_rows, dev_rows, vocab=BERT_TEST_VOCAB):
  root.mkdir(exist_ok=True)
  for split, rows in (("train", train_rows), ("dev", dev_rows)):
    (root / f"{split}.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"{s}\t{l}\n" for s, l in rows), encoding="utf-8")
  (root / "vocab.txt").write_text("".join(t + "\n" for t in vocab), encoding="utf-8")


def test_glue_tsv_reads_tokenizes_and_batches(tmp_path):
  root = tmp_path / "SST-2"
  _write_glue(root, [("unwanted running ", 1), ("Low, lowest!", 0), ("want \"it\"", 1)],
              [("running", 0)])
  ds = get_dataset("glue_tsv", root, split="train", max_len=8)
  assert (ds.name, ds.split, ds.size, ds.num_classes, ds.image_shape) == (
      "glue_tsv", "train", 3, 2, (8,))
  assert (ds.vocab_size, ds.pad_id) == (len(BERT_TEST_VOCAB), 0)
  np.testing.assert_array_equal(ds.ids, [
      [2, 8, 5, 6, 9, 10, 3, 0],
      [2, 12, 11, 13, 1, 3, 0, 0],       # low , lowest ! ("!" is not in the vocab: [UNK])
      [2, 4, 1, 1, 1, 3, 0, 0]])         # want " it " (GLUE files are read without quoting)
  batch = ds.get(np.array([2, 0]), ds.draw(np.random.default_rng(0), 2))
  assert set(batch) == {"image", "label"} and batch["image"].dtype == np.int32
  np.testing.assert_array_equal(batch["label"], [1, 1])
  dev = get_dataset("glue_tsv", root, split="eval", max_len=8)
  assert (dev.split, dev.size) == ("dev", 1)


def test_glue_tsv_errors_name_the_layout(tmp_path):
  with pytest.raises(FileNotFoundError, match="train.tsv"):
    get_dataset("glue_tsv", tmp_path / "absent")
  root = tmp_path / "bad"
  _write_glue(root, [("running", 2)], [("running", 0)])
  with pytest.raises(ValueError, match="label=2 is not allowed"):
    get_dataset("glue_tsv", root)
  (root / "train.tsv").write_text("text\tlabel\nrunning\t1\n")
  with pytest.raises(ValueError, match="no column 'sentence'"):
    get_dataset("glue_tsv", root)
  (root / "train.tsv").write_text("sentence\tlabel\nrunning\t1\textra\n")
  with pytest.raises(ValueError, match="line 2 has 3 fields"):
    get_dataset("glue_tsv", root)


def test_digits_tokens_are_the_pixels():
  ds = get_dataset("digits_tokens", split="test")
  assert (ds.size, ds.num_classes, ds.image_shape, ds.vocab_size, ds.pad_id) == (
      360, 10, (66,), 21, 0)
  bunch = load_digits()
  idx = digits_lib.digits_split_indices("test")
  expected = np.concatenate([np.full((360, 1), 2), bunch.images[idx].reshape(360, 64) + 4,
                             np.full((360, 1), 3)], axis=1)
  np.testing.assert_array_equal(ds.ids, expected)
  np.testing.assert_array_equal(ds.labels, bunch.target[idx])
  assert "digits_tokens" in DATASETS and "glue_tsv" in DATASETS


# -- what the GLUE TSV loader accepts and refuses (issue 33 §1, §4) ------------------------------


def test_glue_tsv_bad_bytes_labels_and_empty_files_name_the_file_and_line(tmp_path):
  from jlp.data import DataFileError
  root = tmp_path / "SST-2"
  _write_glue(root, [("running", 1), ("want", 0)], [("low", 0)])
  train = root / "train.tsv"
  train.write_bytes("sentence\tlabel\nrunning\t1\ncaf\u00e9 low\t0\n".encode("latin-1"))
  with pytest.raises(DataFileError, match=r"train.tsv: line 3 is not UTF-8 \(byte 0xe9.*UTF-8"):
    get_dataset("glue_tsv", root)
  train.write_text("sentence\tlabel\nrunning\t1\nwant\t2\nlow\t0\nwanted\t-1\nlowest\tx\n",
                   encoding="utf-8")
  with pytest.raises(DataFileError) as e:
    get_dataset("glue_tsv", root)
  assert e.value.path == str(train)
  assert str(e.value).startswith(f"{train}: line 3: label=2 is not allowed; expected 0..1 "
                                 "(num_classes=2) (and 2 more bad lines: 5, 6)"), str(e.value)
  train.write_text("sentence\tlabel\nrunning\t1\nwant\t2\n", encoding="utf-8")
  assert get_dataset("glue_tsv", root, num_classes=3).labels.tolist() == [1, 2]
  (root / "dev.tsv").write_text("sentence\tlabel\n", encoding="utf-8")
  with pytest.raises(DataFileError, match=r"dev.tsv: no examples: the file holds only its header"):
    get_dataset("glue_tsv", root, split="dev")
  (root / "dev.tsv").write_bytes(b"")
  with pytest.raises(DataFileError, match=r"dev.tsv: the file is empty"):
    get_dataset("glue_tsv", root, split="dev")
  (root / "vocab.txt").write_bytes(b"[PAD]\n[UNK]\n[CLS]\n[SEP]\ncaf\xe9\n")
  with pytest.raises(DataFileError, match=r"vocab.txt: line 5 is not UTF-8"):
    get_dataset("glue_tsv", root, split="train", num_classes=3)


def test_glue_tsv_accepts_a_bom_crlf_and_blank_lines_at_the_end(tmp_path):
  root = tmp_path / "SST-2"
  _write_glue(root, [("running", 1)], [("low", 0)])
  (root / "train.tsv").write_bytes(
      b"\xef\xbb\xbfsentence\tlabel\r\nrunning\t1\r\nlow , want\t0\r\n\r\n")
  (root / "dev.tsv").write_text("sentence\tlabel\nlow\t0\n\n", encoding="utf-8")
  (root / "vocab.txt").write_bytes(b"\xef\xbb\xbf" + "".join(
      t + "\n" for t in BERT_TEST_VOCAB).encode())
  ds = get_dataset("glue_tsv", root, max_len=6)
  np.testing.assert_array_equal(ds.ids, [[2, 9, 10, 3, 0, 0], [2, 12, 11, 4, 3, 0]])
  np.testing.assert_array_equal(ds.labels, [1, 0])
  assert get_dataset("glue_tsv", root, split="dev").size == 1
  (root / "dev.tsv").write_text("sentence\tlabel\nlow\t0\n\nwant\t1\n", encoding="utf-8")
  with pytest.raises(ValueError, match=r"dev.tsv: line 3 has 1 fields; expected 2 like the "
                     r"header \(a blank line\)"):
    get_dataset("glue_tsv", root, split="dev")


def test_glue_tsv_manifest_and_verify(tmp_path):
  from jlp.data import DataFileError
  root = tmp_path / "SST-2"
  _write_glue(root, [("running", 1), ("want", 0)], [("low", 0)])
  ds = get_dataset("glue_tsv", root)
  manifest = ds.manifest()
  assert [m.split(" ")[0] for m in manifest] == ["train.tsv", "vocab.txt"]
  assert all(len(m.split(" sha256=")[1]) == 64 for m in manifest)
  assert ds.verify() == [] and get_dataset("glue_tsv", root).manifest() == manifest
  (root / "train.tsv").write_text("sentence\tlabel\nrunning\t1\nwant\t3\nlow\t1\textra\n",
                                  encoding="utf-8")
  assert ds.manifest()[0] != manifest[0] and ds.manifest()[1] == manifest[1]
  bad = ds.verify()
  assert all(isinstance(e, DataFileError) and e.path == str(root / "train.tsv") for e in bad)
  assert [e.problem.split(" ")[1].rstrip(":") for e in bad] == ["3", "4"]


def test_a_root_with_a_tilde_is_expanded(tmp_path, monkeypatch):
  from jlp.data import registry
  monkeypatch.setenv("HOME", str(tmp_path))
  _write_glue(tmp_path / "SST-2", [("running", 1)], [("low", 0)])
  assert get_dataset("glue_tsv", "~/SST-2").size == 1
  assert get_dataset("glue_tsv", "~/SST-2", vocab="~/SST-2/vocab.txt").size == 1
  monkeypatch.setenv(registry.DATA_DIR_ENV, "~")
  assert registry.default_root("glue_tsv") == str(tmp_path / "SST-2")
  assert get_dataset("glue_tsv").size == 1
