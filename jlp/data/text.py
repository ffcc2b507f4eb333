"""Sentence classification for the BERT configs: BERT's WordPiece tokenizer, GLUE-style TSV files,
and the bundled digits as token sequences (real text-shaped data that works offline).

Batches are {"image": int32 token ids (B, T), "label": int32 (B,)}: the ids sit under "image" so
that the train step's `model(batch["image"])` (jlp.train.step.cross_entropy_loss) feeds them to
`jlp.models.Bert`, whose `pad_id` knob masks the padding out of attention. Every sequence is
[CLS] w_1 ... w_k [SEP] [PAD] ... [PAD], cut to `max_len` (the words first), one segment
(token type 0), as BERT's `run_classifier.py` builds single-sentence inputs.

Tokenizer (`WordPiece`), as google-research/bert `tokenization.py` (FullTokenizer):
  basic: drop NUL, U+FFFD and control characters, map whitespace to " ", put spaces around CJK
    ideographs, split on whitespace; with `lowercase`: lower-case, then strip accents (NFD,
    drop the combining marks, category Mn); split every punctuation character off as its own
    word (ASCII 33-47, 58-64, 91-96, 123-126 and every Unicode category P*).
  wordpiece: per word, greedy longest-match-first over the vocabulary, pieces after the first
    prefixed "##"; a word with no complete segmentation, or longer than 200 characters, is
    one [UNK].
  vocab.txt: one token per line, id = line number (0-based), as BERT checkpoints ship it.

Data sets (jlp.data.get_dataset):
  "glue_tsv"       root holds train.tsv and dev.tsv (GLUE SST-2 layout: a header line
                   "sentence<TAB>label", then one example per line, no quoting) and vocab.txt
                   (or pass `vocab`); options vocab, max_len (128), lowercase (True),
                   text_column ("sentence"), label_column ("label"), num_classes (2).
                   Files are UTF-8 (a BOM is skipped; \n or \r\n line ends; blank lines at
                   the end are ignored). Refused with DataFileError naming the file and line:
                   bytes that are not UTF-8, a row whose field count differs from the
                   header's, a label that is not an integer in 0..num_classes-1, a file with
                   no example after the header (docs/data.md#glue-tsv).
                   `manifest()`: "<file> sha256=<hex>" of the split's TSV and of vocab.txt.
  "digits_tokens"  scikit-learn's digits (jlp.data.digits split) as sentences of their 64 pixel
                   values "0".."16" (row-major), tokenized with WordPiece over DIGITS_VOCAB
                   ([PAD] [UNK] [CLS] [SEP] then "0".."16": token id = pixel + 4): 66 ids,
                   classify the digit. Needs no files.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jlp.data.dataset import Batch, Dataset, DataFileError, check_split, require_file

__all__ = ["DIGITS_VOCAB", "GlueTsvDataset", "TokenDataset", "WordPiece", "digits_tokens",
           "glue_tsv", "load_vocab"]

PAD, UNK, CLS, SEP = "[PAD]", "[UNK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP)
#: Longest word WordPiece segments; longer words become [UNK] (google-research/bert's value).
MAX_WORD_CHARS = 200
#: digits_tokens' vocabulary: the special tokens, then the pixel values 0..16 as words.
DIGITS_VOCAB = SPECIAL_TOKENS + tuple(str(v) for v in range(17))

GLUE_TREE = """\
train.tsv     sentence<TAB>label header, then one example per line (GLUE SST-2)
dev.tsv       the same, the evaluation split
vocab.txt     the BERT vocabulary, one token per line (or the `vocab` option)"""


def _invalid(field: str, given: Any, allowed: str) -> ValueError:
  return ValueError(f"{field}={given!r} is not allowed; expected {allowed}.")


def read_lines(path: str | os.PathLike) -> list[str]:
  """The lines of the UTF-8 text file `path`, without their ends (\n or \r\n) and without a
  leading byte-order mark. Bytes that are not UTF-8 raise DataFileError naming the line."""
  path = os.fspath(path)
  with open(path, "rb") as f:
    data = f.read()
  if data.startswith(codecs.BOM_UTF8):
    data = data[len(codecs.BOM_UTF8):]
  raw_lines = data.split(b"\n")
  if raw_lines[-1] == b"":
    raw_lines.pop()  # the last line's end
  lines = []
  for number, raw in enumerate(raw_lines, start=1):
    if raw.endswith(b"\r"):
      raw = raw[:-1]
    try:
      lines.append(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise DataFileError(path, (
          f"line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
          "the file must be UTF-8, as GLUE ships it: convert it, e.g. "
          "iconv -f latin1 -t utf-8 (if it is latin-1)")) from None
  return lines


def load_vocab(path: str | os.PathLike) -> dict[str, int]:
  """{token: id} of a BERT vocab.txt (UTF-8, one token per line, id = 0-based line number)."""
  return {line.strip(): index for index, line in enumerate(read_lines(path))}


def file_digest(path: str | os.PathLike) -> str:
  """The SHA-256 of the file's bytes, in hex."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _is_whitespace(ch: str) -> bool:
  return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
  return ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
  return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or
          0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or
          0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class WordPiece:
  """BERT's FullTokenizer over a vocabulary (module docstring).

  vocab: {token: id} or a sequence of tokens (id = position); it must hold [PAD], [UNK], [CLS]
  and [SEP].
  """

  def __init__(self, vocab: dict[str, int] | Sequence[str], *, lowercase: bool = True):
    if not isinstance(vocab, dict):
      vocab = {t: i for i, t in enumerate(vocab)}
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
      raise _invalid("vocab", f"<{len(vocab)} tokens without {', '.join(missing)}>",
                     f"a vocabulary holding {', '.join(SPECIAL_TOKENS)}")
    self.vocab = dict(vocab)
    self.lowercase = lowercase
    self.pad_id, self.unk_id = self.vocab[PAD], self.vocab[UNK]
    self.cls_id, self.sep_id = self.vocab[CLS], self.vocab[SEP]

  @property
  def vocab_size(self) -> int:
    """One more than the largest id (the embedding table's rows)."""
    return max(self.vocab.values()) + 1

  def basic_tokens(self, text: str) -> list[str]:
    """The words and punctuation marks of `text` (the basic tokenizer)."""
    chars = []
    for ch in text:
      cp = ord(ch)
      if cp == 0 or cp == 0xFFFD or _is_control(ch):
        continue
      if _is_whitespace(ch):
        chars.append(" ")
      elif _is_cjk(cp):
        chars.append(f" {ch} ")
      else:
        chars.append(ch)
    out = []
    for word in "".join(chars).split():
      if self.lowercase:
        word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                       if unicodedata.category(c) != "Mn")
      current = ""
      for ch in word:
        if _is_punctuation(ch):
          if current:
            out.append(current)
          out.append(ch)
          current = ""
        else:
          current += ch
      if current:
        out.append(current)
    return out

  def word_pieces(self, word: str) -> list[str]:
    """Greedy longest-match-first segmentation of one word ([UNK] when there is none)."""
    if len(word) > MAX_WORD_CHARS:
      return [UNK]
    pieces, start = [], 0
    while start < len(word):
      end = len(word)
      while end > start:
        piece = word[start:end] if start == 0 else "##" + word[start:end]
        if piece in self.vocab:
          break
        end -= 1
      if end == start:
        return [UNK]
      pieces.append(piece)
      start = end
    return pieces

  def tokenize(self, text: str) -> list[str]:
    """The WordPiece tokens of `text` (no special tokens)."""
    return [p for w in self.basic_tokens(text) for p in self.word_pieces(w)]

  def encode(self, text: str, max_len: int) -> np.ndarray:
    """int32[max_len]: [CLS] tokens [SEP] [PAD]..., the tokens cut to max_len - 2."""
    if not (isinstance(max_len, int) and max_len >= 2):
      raise _invalid("max_len", max_len, "an int >= 2 ([CLS] and [SEP])")
    ids = [self.vocab[t] for t in self.tokenize(text)][:max_len - 2]
    ids = [self.cls_id] + ids + [self.sep_id]
    return np.asarray(ids + [self.pad_id] * (max_len - len(ids)), np.int32)

  def encode_all(self, texts: Iterable[str], max_len: int) -> np.ndarray:
    """int32[N, max_len]: `encode` of every text."""
    rows = [self.encode(t, max_len) for t in texts]
    return np.stack(rows) if rows else np.zeros((0, max_len), np.int32)


class TokenDataset(Dataset):
  """Token-id sequences (N, T) and labels in memory; no augmentation. `image_shape` is (T,)."""

  in_memory = True

  def __init__(self, name: str, split: str, ids: np.ndarray, labels: np.ndarray,
               num_classes: int, *, vocab_size: int, pad_id: int):
    ids, labels = np.asarray(ids), np.asarray(labels)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
      raise _invalid("ids", f"{ids.dtype}{ids.shape}", "integer (N, T)")
    if labels.shape != ids.shape[:1]:
      raise _invalid("labels.shape", labels.shape, f"({ids.shape[0]},) to match the ids")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
      bad = labels[(labels < 0) | (labels >= num_classes)][0]
      raise _invalid("label", int(bad), f"0..{num_classes - 1} (num_classes={num_classes})")
    self.name, self.split = name, split
    self.ids, self.labels = ids.astype(np.int32), labels.astype(np.int32)
    self.num_classes = num_classes
    self.vocab_size, self.pad_id = vocab_size, pad_id
    self.augment = False

  @property
  def size(self) -> int:
    return self.ids.shape[0]

  @property
  def image_shape(self) -> tuple[int, ...]:
    return (self.ids.shape[1],)

  def draw(self, rng: np.random.Generator, n: int) -> Batch:
    del rng, n
    return {}

  def get(self, indices: np.ndarray, params: Batch) -> Batch:
    del params
    return {"image": self.ids[indices], "label": self.labels[indices]}


def parse_tsv(path: str, text_column: str, label_column: str, num_classes: int
              ) -> tuple[list[str], list[int], list[tuple[int, str]]]:
  """(sentences, labels, problems) of a GLUE TSV file: a header line naming the columns, then
  one example per line, fields split at tabs (no quoting). `problems` lists every bad line as
  (line number, "line N ..."); a file that cannot be read as a whole (not UTF-8, empty, no such
  column, no example) raises DataFileError."""
  lines = read_lines(path)
  while lines and not lines[-1].strip():
    lines.pop()  # blank lines at the end
  if not lines:
    raise DataFileError(path, "the file is empty; expected a header line "
                        f"({text_column}<TAB>{label_column}) and one example per line")
  header = lines[0].split("\t")
  for column, option in ((text_column, "text_column"), (label_column, "label_column")):
    if column not in header:
      raise DataFileError(path, (
          f"line 1, the header {header!r}, has no column {column!r} (the {option} option); "
          "expected a header line naming the columns, as GLUE's files have"))
  if len(lines) == 1:
    raise DataFileError(path, "no examples: the file holds only its header line")
  t, l = header.index(text_column), header.index(label_column)
  texts, labels, problems = [], [], []
  for number, line in enumerate(lines[1:], start=2):
    row = line.split("\t")
    if len(row) != len(header):
      problems.append((number, f"line {number} has {len(row)} fields; expected {len(header)} "
                       "like the header" + (" (a blank line)" if not line.strip() else "")))
      continue
    try:
      label = int(row[l])
    except ValueError:
      problems.append((number, f"line {number}: label {row[l]!r} is not an integer"))
      continue
    if not 0 <= label < num_classes:
      problems.append((number, f"line {number}: label={label} is not allowed; expected "
                       f"0..{num_classes - 1} (num_classes={num_classes})"))
      continue
    texts.append(row[t])
    labels.append(label)
  return texts, labels, problems


def read_tsv(path: str, text_column: str, label_column: str, num_classes: int = 2
             ) -> tuple[list[str], list[int]]:
  """(sentences, integer labels) of a GLUE TSV file (`parse_tsv`); the first bad line raises
  DataFileError, which also counts the others."""
  texts, labels, problems = parse_tsv(path, text_column, label_column, num_classes)
  if problems:
    more = ""
    if len(problems) > 1:
      numbers = [str(number) for number, _ in problems[1:11]]
      more = (f" (and {len(problems) - 1} more bad lines: " + ", ".join(numbers) +
              (", ..." if len(problems) > 11 else "") + ")")
    raise DataFileError(path, problems[0][1] + more)
  return texts, labels


class GlueTsvDataset(TokenDataset):
  """A tokenized GLUE TSV split that remembers its files: `verify()` re-reads them and returns
  every bad line, `manifest()` names them with their content digests."""

  def __init__(self, root: str, path: str, vocab_path: str, text_column: str,
               label_column: str, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.root, self.path, self.vocab_path = root, path, vocab_path
    self.text_column, self.label_column = text_column, label_column

  def verify(self) -> list[DataFileError]:
    """A DataFileError per bad line of the split's TSV (or per unreadable file)."""
    errors = []
    try:
      load_vocab(self.vocab_path)
    except (DataFileError, OSError) as e:
      errors.append(e if isinstance(e, DataFileError) else DataFileError(self.vocab_path, str(e)))
    try:
      problems = parse_tsv(self.path, self.text_column, self.label_column, self.num_classes)[2]
      errors += [DataFileError(self.path, problem) for _, problem in problems]
    except DataFileError as e:
      errors.append(e)
    except OSError as e:
      errors.append(DataFileError(self.path, str(e)))
    return errors

  def manifest(self) -> list[str]:
    """["<split>.tsv sha256=<hex>", "vocab.txt sha256=<hex>"]: names relative to root (a vocab
    outside root by its absolute path), so that an edited file counts as a change."""
    out = []
    for path in (self.path, self.vocab_path):
      rel = os.path.relpath(path, self.root)
      name = rel.replace(os.sep, "/") if not rel.startswith(os.pardir) else os.path.abspath(path)
      out.append(f"{name} sha256={file_digest(path)}")
    return out


def glue_tsv(root: str | os.PathLike, split: str = "train", *, vocab: str = "",
             max_len: int = 128, lowercase: bool = True, text_column: str = "sentence",
             label_column: str = "label", num_classes: int = 2) -> GlueTsvDataset:
  """A GLUE-style single-sentence TSV split (root/train.tsv or root/dev.tsv), tokenized.

  vocab: the BERT vocab.txt ("" = root/vocab.txt; "~" expanded); lowercase: True for uncased
  vocabularies; num_classes: labels must lie in 0..num_classes-1.
  """
  check_split(split, ("train", "dev"))
  if not isinstance(num_classes, int) or num_classes < 1:
    raise _invalid("num_classes", num_classes, "a positive int")
  root = os.path.expanduser(os.fspath(root))
  path = require_file(os.path.join(root, f"{split}.tsv"), "glue_tsv", root, GLUE_TREE)
  vocab_path = require_file(os.path.expanduser(vocab) if vocab else os.path.join(root, "vocab.txt"),
                            "glue_tsv", root, GLUE_TREE)
  tokenizer = WordPiece(load_vocab(vocab_path), lowercase=lowercase)
  texts, labels = read_tsv(path, text_column, label_column, num_classes)
  return GlueTsvDataset(root, path, vocab_path, text_column, label_column,
                        "glue_tsv", split, tokenizer.encode_all(texts, max_len),
                        np.asarray(labels, np.int64), num_classes,
                        vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)


def digits_sentences(images: np.ndarray) -> list[str]:
  """Each 8x8 digit as the sentence of its 64 pixel values (row-major), e.g. "0 0 5 13 ..."."""
  return [" ".join(str(int(v)) for v in img.reshape(-1)) for img in images]


def digits_tokens(root: Any = None, split: str = "train", *, max_len: int = 66) -> TokenDataset:
  """The digits split as token sequences (module docstring; `root` is ignored)."""
  from jlp.data.digits import load_digits_arrays  # pylint: disable=g-import-not-at-top
  del root
  check_split(split, ("train", "test"))
  images, labels = load_digits_arrays(split, "8x8x1")
  tokenizer = WordPiece(DIGITS_VOCAB, lowercase=False)
  ids = tokenizer.encode_all(digits_sentences(images[..., 0]), max_len)
  return TokenDataset("digits_tokens", split, ids, labels, 10,
                      vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
