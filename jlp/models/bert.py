"""A small BERT encoder with a sequence-classification head, Flax NNX.

embeddings  word_embeddings (vocab), position_embeddings (max_len), token_type_embeddings (2),
            layer_norm (eps 1e-12), dropout
layers      num_layers x post-LN transformer layer:
              attention (query, key, value, output: nnx.Linear), attention_dropout -> x = attention_norm(x + attn)
              intermediate (Linear hidden -> mlp_dim, exact erf GELU), output (Linear mlp_dim -> hidden),
              output_dropout -> x = output_norm(x + mlp)
pooler      Linear(hidden, hidden) + tanh on the [CLS] (first) token
classifier  Linear(hidden, num_classes) after dropout

Every parameter GEMM is an `nnx.Linear` (paths "layers/0/attention/query", ..., "layers/0/intermediate",
"layers/0/output", "pooler", "classifier"). The embedding lookups are gathers, not GEMMs.
Defaults are BERT-Small (Turc et al. 2019): 4 layers, hidden 512, 8 heads, MLP 2048, vocab 30522,
max_len 512. Init: N(0, 0.02) for weights and embeddings, zero biases, LayerNorm 1/0 (as BERT).
Dropout (0.1) is switched with model.eval() / model.train() (or `deterministic=` at construction);
it draws from the "dropout" stream of the `rngs` given at construction (or the default stream).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Bert", "BertEmbeddings", "BertLayer", "MultiHeadSelfAttention", "bert_small"]

_W_INIT = nnx.initializers.normal(0.02)


def _dense(i, o, rngs):
  return nnx.Linear(i, o, kernel_init=_W_INIT, bias_init=nnx.initializers.zeros, rngs=rngs)


class MultiHeadSelfAttention(nnx.Module):
  """Multi-head self-attention.

    The projections query/key/value/output are `nnx.Linear` layers (parameter GEMMs, reachable by
    quantization rules). The two activation-activation products, the scores q·kᵀ and the context
    probs·v, are computed with `jnp.einsum` inside this module: they involve no parameters and are
    therefore *not* param layers (a rule on this module's Linear layers does not quantize them).
    """

  def __init__(self,
               hidden: int,
               heads: int,
               *,
               dropout: float = 0.1,
               deterministic: bool = False,
               rngs: nnx.Rngs):
    if hidden % heads:
      raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    self.heads = heads
    self.head_dim = hidden // heads
    self.query = _dense(hidden, hidden, rngs)
    self.key = _dense(hidden, hidden, rngs)
    self.value = _dense(hidden, hidden, rngs)
    self.output = _dense(hidden, hidden, rngs)
    self.dropout = nnx.Dropout(dropout, deterministic=deterministic, rngs=rngs)

  def __call__(self, x, mask=None):
    """x: (B, T, hidden); mask: optional (B, T) with True/1 for tokens that may be attended."""
    b, t, _ = x.shape
    shape = (b, t, self.heads, self.head_dim)
    q = self.query(x).reshape(shape)
    k = self.key(x).reshape(shape)
    v = self.value(x).reshape(shape)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
    if mask is not None:
      scores = jnp.where(mask[:, None, None, :].astype(bool), scores, jnp.finfo(scores.dtype).min)
    probs = self.dropout(jax.nn.softmax(scores, axis=-1))
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1)
    return self.output(ctx)


class BertLayer(nnx.Module):
  """Post-LN transformer encoder layer (as in BERT)."""

  def __init__(self,
               hidden: int,
               heads: int,
               mlp_dim: int,
               *,
               dropout: float = 0.1,
               deterministic: bool = False,
               rngs: nnx.Rngs):
    self.attention = MultiHeadSelfAttention(hidden,
                                            heads,
                                            dropout=dropout,
                                            deterministic=deterministic,
                                            rngs=rngs)
    self.attention_dropout = nnx.Dropout(dropout, deterministic=deterministic, rngs=rngs)
    self.attention_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
    self.intermediate = _dense(hidden, mlp_dim, rngs)
    self.output = _dense(mlp_dim, hidden, rngs)
    self.output_dropout = nnx.Dropout(dropout, deterministic=deterministic, rngs=rngs)
    self.output_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)

  def __call__(self, x, mask=None):
    x = self.attention_norm(x + self.attention_dropout(self.attention(x, mask)))
    h = jax.nn.gelu(self.intermediate(x), approximate=False)
    return self.output_norm(x + self.output_dropout(self.output(h)))


class BertEmbeddings(nnx.Module):

  def __init__(self,
               vocab: int,
               hidden: int,
               max_len: int,
               type_vocab: int,
               *,
               dropout: float = 0.1,
               deterministic: bool = False,
               rngs: nnx.Rngs):
    self.word_embeddings = nnx.Embed(vocab, hidden, embedding_init=_W_INIT, rngs=rngs)
    self.position_embeddings = nnx.Embed(max_len, hidden, embedding_init=_W_INIT, rngs=rngs)
    self.token_type_embeddings = nnx.Embed(type_vocab, hidden, embedding_init=_W_INIT, rngs=rngs)
    self.layer_norm = nnx.LayerNorm(hidden, epsilon=1e-12, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, deterministic=deterministic, rngs=rngs)
    self.max_len = max_len

  def __call__(self, input_ids, token_type_ids=None):
    t = input_ids.shape[-1]
    if t > self.max_len:
      raise ValueError(f"sequence length {t} exceeds max_len {self.max_len}")
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    x = (self.word_embeddings(input_ids) + self.position_embeddings(jnp.arange(t))[None] +
         self.token_type_embeddings(token_type_ids))
    return self.dropout(self.layer_norm(x))


class Bert(nnx.Module):
  """BERT encoder + [CLS] classification head.

    Knobs: vocab, max_len, hidden, num_layers, heads, mlp_dim (default 4 x hidden), num_classes,
    type_vocab (2), dropout (0.1), deterministic (initial dropout mode; model.eval()/train()),
    pad_id (None; an id: when no attention_mask is given, tokens equal to pad_id are not
    attended, the mask a tokenizer gives for [PAD]; this is how the train step's
    ``model(batch["image"])`` masks padding, jlp.data.text).
    Call: ``model(input_ids, token_type_ids=None, attention_mask=None)`` with int (B, T) ids ->
    logits (B, num_classes). ``model.encode(...)`` returns the (B, T, hidden) sequence output.
    """

  def __init__(
      self,
      *,
      vocab: int = 30522,
      max_len: int = 512,
      hidden: int = 512,
      num_layers: int = 4,
      heads: int = 8,
      mlp_dim: int | None = None,
      num_classes: int = 2,
      type_vocab: int = 2,
      dropout: float = 0.1,
      deterministic: bool = False,
      pad_id: int | None = None,
      rngs: nnx.Rngs,
  ):
    mlp_dim = 4 * hidden if mlp_dim is None else mlp_dim
    self.pad_id = pad_id
    det = deterministic
    self.embeddings = BertEmbeddings(vocab,
                                     hidden,
                                     max_len,
                                     type_vocab,
                                     dropout=dropout,
                                     deterministic=det,
                                     rngs=rngs)
    self.layers = nnx.List([
        BertLayer(hidden, heads, mlp_dim, dropout=dropout, deterministic=det, rngs=rngs)
        for _ in range(num_layers)
    ])
    self.pooler = _dense(hidden, hidden, rngs)
    self.dropout = nnx.Dropout(dropout, deterministic=det, rngs=rngs)
    self.classifier = _dense(hidden, num_classes, rngs)

  def encode(self, input_ids, token_type_ids=None, attention_mask=None):
    if attention_mask is None and self.pad_id is not None:
      attention_mask = input_ids != self.pad_id
    x = self.embeddings(input_ids, token_type_ids)
    for layer in self.layers:
      x = layer(x, attention_mask)
    return x

  def __call__(self, input_ids, token_type_ids=None, attention_mask=None):
    x = self.encode(input_ids, token_type_ids, attention_mask)
    pooled = jnp.tanh(self.pooler(x[:, 0]))
    return self.classifier(self.dropout(pooled))


def bert_small(rngs: nnx.Rngs | None = None, **kwargs) -> Bert:
  """BERT-Small encoder (4 layers, hidden 512, 8 heads) with a 2-class head; see `Bert`."""
  rngs = nnx.Rngs(0) if rngs is None else rngs
  return Bert(rngs=rngs, **kwargs)
