"""The BERT stage rule (bert_small).

Units: embeddings, every encoder layer ("layers/0", ...), head (pooler + dropout + classifier).

Default: 12 layers at S=4 -> layers [2, 4, 4, 2] (the seed's BERT-base partition,
`train_bert.py`); otherwise the layers split evenly as for ResNet (bert_small's 4 layers: [2, 2]
for S=2, [1, 1, 1, 1] for S=4).

Stage 0 takes the token ids as `jlp.data.text` batches hold them (batch["image"], int (B, T); what
the train step's `model(batch["image"])` passes), or a mapping with "input_ids" (or "image") and
optional "token_type_ids" and "attention_mask". Between stages: (hidden (B, T, H) float32,
attention mask (B, T) float32: 1 = attend). The mask is `attention_mask`, else
`input_ids != pad_id` when the model has a pad_id (as `Bert.encode`), else all ones
(where(1, s, min) = s: the same scores as no mask).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax.numpy as jnp

from jlp.models.bert import Bert
from jlp.pipeline.stages.base import StageRule, Unit, _body_split

_BERT_KEYS = ("input_ids", "image")


def _bert_embeddings(mods, x, *, pad_id: int | None):
  token_type_ids = attention_mask = None
  if isinstance(x, Mapping):
    key = next((k for k in _BERT_KEYS if k in x), None)
    if key is None:
      raise ValueError(f"BERT stage 0 input keys={sorted(x)!r} are not allowed; expected "
                       f"'input_ids' (or 'image') and optionally 'token_type_ids', "
                       f"'attention_mask'.")
    ids = x[key]
    token_type_ids, attention_mask = x.get("token_type_ids"), x.get("attention_mask")
  else:
    ids = x
  if attention_mask is None and pad_id is not None:
    attention_mask = ids != pad_id
  if attention_mask is None:
    mask = jnp.ones(ids.shape, jnp.float32)
  else:
    mask = jnp.asarray(attention_mask).astype(jnp.float32)
  return mods["embeddings"](ids, token_type_ids), mask


def _bert_layer(mods, x, *, path: str):
  hidden, mask = x
  return mods[path](hidden, mask), mask


def _bert_head(mods, x):
  hidden, _ = x
  pooled = jnp.tanh(mods["pooler"](hidden[:, 0]))
  return mods["classifier"](mods["dropout"](pooled))


def _bert_units(model: Bert) -> list[Unit]:
  units = [Unit("embeddings", ("embeddings",),
                functools.partial(_bert_embeddings, pad_id=model.pad_id))]
  for i in range(len(model.layers)):
    path = f"layers/{i}"
    units.append(Unit(path, (path,), functools.partial(_bert_layer, path=path)))
  units.append(Unit("head", ("pooler", "dropout", "classifier"), _bert_head))
  return units


def _bert_default(model, num_units, num_stages):
  body = (2, 4, 4, 2) if len(model.layers) == 12 and num_stages == 4 else None
  return _body_split(num_units, num_stages, body)


RULE = StageRule(Bert, ("bert_small",), _bert_units, _bert_default,
                 "embeddings, every encoder layer, head; 12 layers at S=4: [2, 4, 4, 2], "
                 "else layers evenly")
