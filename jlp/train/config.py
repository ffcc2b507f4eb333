"""The experiment config schema (ml_collections) shared by every `configs/*.py`, and its checks.

Every config starts from `base_config()` and overrides fields; `python -m experiments.train
--config=configs/NAME.py[:ARG] --config.FIELD=VALUE` changes any of them (unknown fields and wrong
types are rejected by ml_collections). `validate(config)` checks values before anything is built
or compiled and raises ValueError naming the field, the value given and what is allowed.
A field that only acts together with another one is refused when it is set (not its default)
without it, rather than accepted and ignored (the rules are in the list below, marked "Refused");
`resolved(config)` is the config to record (config.json, checkpoints): it says what ran.

Fields (see `base_config` for defaults):
  seed                          PRNG seed: initialisation, data order, augmentation, stochastic rounding.
  task                          "classification" or "segmentation" (per-pixel, label 255 ignored).
  model.name, model.kwargs      a jlp.models.MODELS name and its builder's arguments (num_classes
                                comes from the dataset).
  dataset.name, dataset.root, dataset.kwargs
                                a jlp.data dataset ("digits" needs no root) and its options.
                                Augmentation is for training only: the evaluation split is built
                                with the same options and augment=False, whatever dataset.kwargs
                                say (jlp.train.recipe.eval_kwargs), so its augmentation settings
                                (augment, crop, padding, pad_mode, flip, cutout; imagenet's
                                scale, ratio; cityscapes' scale_range, cat_max_ratio,
                                photometric) act on the training split only, and the other
                                options (variant, recipe, mean, std, imagenet's crop_size /
                                resize_size centre crop, cityscapes' eval_scale, max_len, ...)
                                on both. Classification needs one image shape for both splits (a
                                crop must keep the image size, e.g. crop=32 with padding=4).
  dataset.verify                True: before training, decode every file of both splits and list
                                every one that cannot be used (jlp.data.DataFileError), then stop
                                if there are any (exit 2). Either way a resume refuses a data set
                                whose files changed since the run started (removed, added,
                                reordered or, for text files, edited; the list is kept in
                                WORKDIR/data_files.json.gz) unless --allow_config_change.
  dataset.worker_processes      W > 0: file-backed data sets (ImageNet folders, Cityscapes) are
                                loaded by W worker processes (Grain's multiprocessing prefetch,
                                jlp.data.Pipeline); 0 (default): threads of this process. The
                                batches are the same bits either way; in-memory data sets never
                                start workers. Workers use shared memory (/dev/shm: about 5
                                chunks of 64 examples per worker; Docker: --shm-size).
  batch_size, eval_batch_size   global batch sizes (all devices and processes together).
  max_steps, log_every, eval_every, checkpoint_every
                                loop cadence in steps (0 disables eval / periodic checkpoints; a
                                checkpoint is always written at the end).
  stop_at_accuracy              end the run at the first evaluation whose eval_accuracy reaches
                                it (a checkpoint is written; re-running the workdir says it is
                                finished); 0 (default): off. Data-parallel classification only:
                                time-to-accuracy studies. Refused with eval_every=0.
  lr, schedule                  peak learning rate and schedule (`schedule.name` plus its fields;
                                see jlp.train.optim).
  optimizer                     "sgd" (torch-style SGD; LARS with use_lars) or "adamw" (optax.adamw:
                                adam_b1, adam_b2, adam_eps; decoupled weight_decay, for BERT).
  optimizer fields              momentum, nesterov, weight_decay, wd_exclude (regex over parameter
                                paths without decay, e.g. "bn|bias"), use_lars. SGD and LARS read
                                all four (LARS: optax.lars with weight_decay_mask from wd_exclude,
                                its trust ratio on every parameter, Nesterov momentum with
                                nesterov); adamw reads weight_decay and wd_exclude.
                                Refused: nesterov=True or a momentum other than the default 0.9
                                with "adamw" (its first-moment decay is adam_b1); adam_b1,
                                adam_b2, adam_eps other than their defaults with "sgd".
  gradient sync (CPD)           grad_exp, grad_man (the all-reduce format; (8, 23) = float32),
                                grad_algorithm ("sequential" | "ring" | "psum": XLA's
                                float32 all-reduce), use_aps, aps_mode
                                ("exact" | "cpd"), use_kahan, emulate_nodes, emulate_form
                                ("flat" | "cpd"), emulate_node_map ("unroll": fastest on CPU,
                                compile time grows with emulate_nodes; "scan": one loop body,
                                for many nodes; "vmap": batched, not bit-identical to devices;
                                see jlp.train.step; it acts with one node too: the one-node
                                program unrolled, in a one-trip loop or vmapped differs in the
                                last bits).
                                grad_format decides the all-reduce format. It is a reference,
                                "e{grad_exp}m{grad_man}", until set by name ("e4m3",
                                "float8_e4m3fn", ...; --config.grad_format=NAME on the command line
                                replaces the reference with the name, whatever the flag order);
                                grad_exp / grad_man then change nothing, and any other than the
                                defaults (8, 23) or the format's own widths are refused.
                                `resolved(config)` records grad_exp / grad_man as the widths
                                that ran. Refused: aps_mode other than "exact" without use_aps;
                                emulate_form="cpd" with emulate_nodes=1, except on "resnet50"
                                (whose single local gradient CPD casts: GradSync.cast_single).
  compression.name              "none" (the CPD all-reduce above) or a jlp.compression compressor
                                ("onebit", "tbq", "terngrad", "dgc", "graddrop", ...): gradients
                                are then summed by HiPress's compressed sync (jlp.compression.sync,
                                docs/hipress.md) with per-device error-feedback state, which is
                                checkpointed. Needs the float32 sequential settings of the CPD
                                fields (grad_format e8m23, no APS / Kahan / ring / emulated nodes).
                                Refused with "none": compression.topology, min_size, kwargs or
                                plan other than their defaults ("ps", 262144, {}, "").
  compression.topology          "ps" (CaSync-PS) or "ring" (CaSync-Ring); "allreduce" for
                                "powersgd" (and only it: P and Q summed by all-reduces).
  compression.min_size          compress a gradient iff it has more than min_size elements
                                (HiPress's --comp-threshold, 262144; 0: every gradient).
  compression.kwargs            the compressor's fields, e.g. {"threshold": 2.0} for "tbq"; from
                                the command line as a dict literal:
                                --config.compression.kwargs='{"threshold": 2.0}'.
  compression.plan              "" (min_size decides), the path of a SeCoPa plan file
                                (jlp.compression.secopa.read_plan: `name,size,y|n,K` lines, name
                                = jax.tree_util.keystr of the gradient's path, e.g.
                                "['conv1']['kernel'].value"), or "secopa": SeCoPa's plan for this
                                model with HiPress's seed cost model (4, 8 or 16 devices), or
                                "autotune": before the first step, the plans this compressor can
                                run (every topology it supports, K = devices; and no compression,
                                as psum) are timed as the run's train step on its first batch
                                (from copies of the initial state, thrown away) and the fastest
                                is kept (jlp.sync_tuning.autotune; with a whole-sync fit at
                                compression.sync_fit, only the 4 it ranks highest, each leaf in
                                its best K, and of those only the ones predicted within 2x of
                                the fastest: one left is chosen untimed); the choice and its
                                timings are printed and written to WORKDIR/sync_plan.json, which
                                a resume reuses.
  compression.sync_fit          "" or the path of a jlp.sync_tuning.SyncFit JSON (fitted from
                                whole syncs on this cluster: python -m experiments.sync_fit)
                                that ranks autotune's candidates.
  Every step logs wire_bytes: the bytes one device sends for the gradient sync (jlp.train.step).
  diloco.period                 H > 0: DiLoCo (Douillard et al. 2023; jlp.sync.DiLoCo,
                                docs/baselines.md): every device is a replica that runs H inner
                                steps of the config's optimizer (lr, schedule, momentum, ...: its
                                state per replica) on its own share of each batch, then the outer
                                gradient (outer params - replica params) is averaged over the
                                devices, the outer optimizer updates the outer params and every
                                replica continues from them. 0 (default): off, the data-parallel
                                step above. wire_bytes is the outer sync's bytes on the steps that
                                sync and 0 on the others. Evaluation runs the outer params (the
                                global model) with the replicas' mean BatchNorm statistics. The
                                gradient-sync fields (grad_format, use_aps, aps_mode, use_kahan,
                                grad_algorithm) set how the outer gradients are summed
                                (DiLoCo's outer_sync; the defaults: a float32 mean). Refused:
                                the other diloco fields other than their defaults with period 0;
                                with period > 0, pipeline.schedule, compression.name,
                                emulate_nodes > 1, bfp.schedule, bfp.controller and
                                quant_recipe "fp8_delayed" (each needs the data-parallel step).
  diloco.outer_optimizer        name "sgd" (torch-style SGD: jlp.train.optim.torch_sgd), lr,
                                momentum, nesterov: DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9
                                by default; lr 1 with momentum 0 and nesterov False is FedAvg.
  diloco.fragments              Streaming DiLoCo (Douillard et al. 2025): P fragments of the
                                parameter leaves (by leaf order, about equal sizes), each synced
                                at its own inner step, strided over the period (1 <= P <= H).
  diloco.overlap, diloco.alpha  a fragment's outer update lands tau inner steps after its outer
                                gradient was taken (0 <= tau < H), merged as alpha * local +
                                (1 - alpha) * global (alpha in [0, 1]; 0: assigned).
  diloco.outer_format           "" (default) or a float format of at most 8 bits ("e2m1", "e3m0",
                                "e4m3", ...): the outer gradients cross as its codes with a
                                power-of-two scale per fragment. Refused with gradient-sync fields
                                other than their float32 sequential defaults.
  diloco.average_state          True: BatchNorm statistics averaged over the replicas at every
                                period-th step; False (default): per replica.
  loss_scale                    static loss scale (the reduced gradient is divided by it).
  unscale_grads                 False: CPD DavidNet's bug, the loss scale is never divided out
                                (the optimizer gets loss_scale x the gradient; docs/cpd.md).
  quant_rules                   ((regex, {GemmQuant field: format name or value}), ...): jlp.nn
                                quantization rules over module paths, first match wins (checked
                                before the preset's rules), e.g. ((".*", {"x": "e4m3", "w": "e4m3",
                                "dgrad_dy": "e5m2", "wgrad_dy": "e5m2"}),) for an fp8 model.
  quant_recipe                  "none" (default) or a low-precision training recipe by name
                                (jlp.nn.recipes: "nvfp4", "mxfp8", "mxfp4", "deepseek_fp8",
                                "fp8_current", "fp8_delayed"; "fp8_delayed", TE's
                                DelayedScaling, keeps amax histories and scales in the model
                                state, updated by the data-parallel step with a max over the
                                devices, and is not supported with pipeline.schedule): its
                                jlp.nn rules (`recipe_rules`) are put on the model after
                                quant_rules, so quant_rules override the recipe for the layers
                                they match (first match wins; the recipe ends in a catch-all
                                rule for every Linear and Conv layer). "nvfp4" finds the first
                                and last GEMM layers, kept in float32, by tracing the model on the
                                first training batch. Stochastic rounding (of a recipe or of
                                quant_rules) draws from nnx.Rngs(quant=seed + 2) (per layer and
                                call, jlp.nn.rules). Not with bfp.preset / bfp.schedule /
                                bfp.controller (the recipe's catch-all would shadow a preset).
  quant_recipe_accumulator      True (default): the recipe's accumulator model ("deepseek_fp8":
                                14-bit truncating accumulation promoted every 128 products,
                                about 9x the float32 step on a CPU); False: its formats with
                                float32 GEMMs (`recipe_rules(..., accumulator=False)`; the other
                                recipes have no accumulator model).
  bfp.preset                    BFPsim preset name or JSON path applied with jlp.nn rules ("" =
                                none), for the whole run. Refused with a non-empty bfp.schedule (the
                                schedule decides the preset; set one or the other).
  bfp.schedule                  {epoch: preset} switched at epoch boundaries (BFPsim's
                                bfp-layer-conf-dict, intended semantics: optimizer state and LR
                                schedule continue).
  bfp.controller, bfp.window    "Simple/<lo>/<hi>/<init>/<hold>" dynamic precision control over
                                windows of `window` steps ("" = off; 0 = one epoch). Refused:
                                bfp.window other than 0 without a controller.
  pipeline.*                    pipelined data parallelism (SD-PIPE, docs/sdpipe.md; jlp.pipeline,
                                jlp.train.pipeline_loop): N pipelines x S stages on N*S devices.
                                With schedule "none" (default) the other pipeline fields must keep
                                their defaults and the run is the data-parallel step above.
  pipeline.schedule             "none" | "gpipe" (M micro-batches per mini-batch, one synchronous
                                update per mini-batch) | "1f1b" (SD-PIPE's PipeDream 1F1B with
                                weight stashing: every mini-batch its own update, docs/sdpipe.md)
                                | a flush schedule, each GPipe's update: "1f1b_flush"
                                (PipeDream-Flush), "interleaved_1f1b" (v chunks per device),
                                "zb_h1", "zbv", "dualpipev" (two chunks per device in a V) |
                                "csv" (the torch compute-only CSV file pipeline.schedule_csv).
                                The flush schedules sync "allreduce" or "none", without hetero
                                or slowdown.
  pipeline.stages               S, the devices of a pipeline (the model split by jlp.pipeline's
                                stage rules into v * S parts; small_cnn, resnet18/50, vgg19,
                                bert_small).
  pipeline.virtual_stages       v, stages per device: 0 (default) = the schedule's own
                                (interleaved_1f1b 2, zbv and dualpipev 2, the rest 1); any v >= 1
                                with "interleaved_1f1b".
  pipeline.schedule_csv         with schedule "csv": the path of a torch.distributed.pipelining
                                compute-only CSV (one row per device of a pipeline; its stages
                                over devices give v), run with its per-device orders.
  pipeline.pipelines            N; 0 (default): every device, N = devices / S (S must divide the
                                device count); else N pipelines on the first N*S devices.
                                batch_size stays global: pipeline i trains on rows [i*b, (i+1)*b)
                                of each batch, b = batch_size / N.
  pipeline.microbatches         M of GPipe and the flush schedules (batch_size must divide by
                                N*M); 1 for "1f1b".
  pipeline.sync                 across the pipelines, per stage: "allreduce" (mean gradient, with
                                the gradient-sync fields above: format, APS, Kahan, compression) |
                                "none" | "preduce" (SD-PIPE's partial reduce) | "adpsgd"
                                (random perfect matchings; N even) | "hetpipe" (a parameter
                                server copy). Every mode but "allreduce" needs the float32
                                sequential defaults of the gradient-sync fields.
  pipeline.hetero               the seed's --hetero h: each op stalls h virtual seconds with
                                probability pipeline.hetero_probability (0.1).
  pipeline.slowdown             () or an [N][S] tuple of per-(pipeline, stage) compute-time factors
                                (persistent slow workers; an extension).
  pipeline.boundaries           () (the stage rule's default, e.g. ResNet-50 at S=4: blocks
                                [4, 4, 4, 4]) or S unit counts (jlp.pipeline.stages).
  pipeline.max_group, pipeline.connect_every
                                partial reduce: group cap (0: N) and the connectivity period P
                                (a forced connection every P*N group members).
  pipeline.pull_every, pipeline.barrier
                                HetPipe: pull the server copy every D mini-batches; wave barrier.
  pipeline.batches_per_call     mini-batches per jitted `Pipeline.run` call (default 10): a
                                performance knob only (1F1B's pipeline stays full from one call
                                to the next and the virtual time is one timeline of the whole
                                training; the runner flushes at max_steps). Calls start at
                                multiples of it (the last one may be shorter), so eval_every and
                                checkpoint_every must be multiples of it (evaluation and
                                checkpoints happen between calls); log_every is free (every
                                mini-batch's loss and virtual time come back). Rows add
                                `virtual_time` (virtual seconds, jlp.pipeline.timeline),
                                `virtual_throughput` (examples per virtual second over the call),
                                `bubble_fraction`, `idle_fraction` (virtual time) and
                                `idle_slot_fraction` (ticks); eval metrics are the mean
                                over the N pipelines' models, each evaluated on the whole eval
                                split.
"""

from __future__ import annotations

import os
import re
from typing import Any

import ml_collections

from jlp.formats import FloatFormat, as_format
from jlp.sync import ALGORITHMS, DEFAULT_MIN_SIZE, FORMS, NODE_MAPS, SYNC_TOPOLOGIES

#: Appended to every error and warning about the number of devices.
DEVICE_HINT = ("on a CPU machine, --cpu_devices=N emulates N devices; across machines, run it "
               "under python -m experiments.cluster")
TASKS = ("classification", "segmentation")
OPTIMIZERS = ("sgd", "adamw")
APS_MODES = ("exact", "cpd")
#: The model whose single local gradient emulate_form="cpd" casts with one node (CPD's ResNet50;
#: jlp.train.recipe.grad_sync's cast_single).
CAST_SINGLE_MODEL = "resnet50"
#: config.compression.plan value: plan with SeCoPa's seed cost model for the model being trained.
SECOPA = "secopa"
#: config.compression.plan value: time the best ranked plans on the live devices, keep the fastest.
AUTOTUNE = "autotune"
PIPELINE_SCHEDULES = ("none", "gpipe", "1f1b", "1f1b_flush", "interleaved_1f1b", "zb_h1", "zbv",
                      "dualpipev", "csv")
#: The flush schedules the pipelined runner runs with jlp.pipeline.flush (all but GPipe and 1F1B).
FLUSH_PIPELINE_SCHEDULES = PIPELINE_SCHEDULES[3:]
#: Defaults of the optimizer fields that only one optimizer reads (`validate` refuses another
#: value with the other optimizer).
SGD_MOMENTUM = 0.9
ADAM_DEFAULTS = {"adam_b1": 0.9, "adam_b2": 0.999, "adam_eps": 1e-8}
#: The float32 gradient format's (grad_exp, grad_man): CPD's plain all-reduce.
FLOAT32_EXP_MAN = (8, 23)
#: config.pipeline's fields and defaults (module docstring).
PIPELINE_DEFAULTS = {
    "schedule": "none", "stages": 1, "pipelines": 0, "microbatches": 1, "sync": "allreduce",
    "hetero": 0.0, "hetero_probability": 0.1, "slowdown": (), "boundaries": (), "max_group": 0,
    "connect_every": 10, "pull_every": 10, "barrier": False, "batches_per_call": 10,
    "virtual_stages": 0, "schedule_csv": "",
}


def base_config() -> ml_collections.ConfigDict:
  """The defaults every experiment config starts from."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "classification"
  c.model = ml_collections.ConfigDict({"name": "small_cnn", "kwargs": ml_collections.ConfigDict()})
  c.dataset = ml_collections.ConfigDict(
      {"name": "digits", "root": "", "kwargs": ml_collections.ConfigDict(), "verify": False,
       "worker_processes": 0})
  c.batch_size = 128
  c.eval_batch_size = 256
  c.max_steps = 100
  c.log_every = 10
  c.eval_every = 50
  c.checkpoint_every = 50
  c.stop_at_accuracy = 0.0

  c.lr = 0.1
  c.schedule = ml_collections.ConfigDict({"name": "constant"})
  c.momentum = SGD_MOMENTUM
  c.nesterov = False
  c.weight_decay = 0.0
  c.wd_exclude = ""
  c.use_lars = False
  c.optimizer = "sgd"
  c.adam_b1 = ADAM_DEFAULTS["adam_b1"]
  c.adam_b2 = ADAM_DEFAULTS["adam_b2"]
  c.adam_eps = ADAM_DEFAULTS["adam_eps"]

  c.grad_exp, c.grad_man = FLOAT32_EXP_MAN
  c.grad_format = "e" + c.get_ref("grad_exp").to_str() + "m" + c.get_ref("grad_man").to_str()
  c.grad_algorithm = "sequential"
  c.use_aps = False
  c.aps_mode = "exact"
  c.use_kahan = False
  c.emulate_nodes = 1
  c.emulate_form = "flat"
  c.emulate_node_map = "unroll"
  c.loss_scale = 1.0
  c.unscale_grads = True
  c.compression = ml_collections.ConfigDict({
      "name": "none", "topology": "ps", "min_size": DEFAULT_MIN_SIZE,
      "kwargs": ml_collections.ConfigDict(), "plan": "", "sync_fit": ""})

  c.quant_rules = ()
  c.quant_recipe = "none"
  c.quant_recipe_accumulator = True
  c.bfp = ml_collections.ConfigDict({
      "preset": "", "schedule": ml_collections.ConfigDict(), "controller": "", "window": 0})
  c.diloco = diloco_defaults()
  c.pipeline = ml_collections.ConfigDict(PIPELINE_DEFAULTS)
  return c


#: config.diloco's fields and defaults (module docstring): DiLoCo off.
DILOCO_DEFAULTS = {
    "period": 0, "fragments": 1, "overlap": 0, "alpha": 0.0, "outer_format": "",
    "average_state": False,
    "outer_optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True},
}
#: config.diloco.outer_optimizer.name values.
OUTER_OPTIMIZERS = ("sgd",)


def diloco_defaults() -> ml_collections.ConfigDict:
  """config.diloco as base_config sets it (a fresh copy)."""
  fields = dict(DILOCO_DEFAULTS)
  fields["outer_optimizer"] = ml_collections.ConfigDict(dict(DILOCO_DEFAULTS["outer_optimizer"]))
  return ml_collections.ConfigDict(fields)


def local_digits(c: ml_collections.ConfigDict, *, max_steps: int, batch_size: int = 64,
                 **model_kwargs: Any) -> ml_collections.ConfigDict:
  """The `:local` CPU smoke variant of a CIFAR/ImageNet-shaped recipe, in place: the bundled
  digits at 32x32x3 (no data download), the model's knobs `model_kwargs` (e.g. width=8), a short
  run with evaluation and checkpoints at its middle and end."""
  from jlp.data import config_kwargs  # pylint: disable=g-import-not-at-top
  c.dataset.name = "digits"
  c.dataset.root = ""
  c.dataset.kwargs = config_kwargs("digits", variant="32x32x3")
  c.model.kwargs = model_kwargs
  c.batch_size = batch_size
  c.eval_batch_size = 120
  c.max_steps = max_steps
  c.log_every = max(1, max_steps // 4)
  c.eval_every = c.checkpoint_every = max(1, max_steps // 2)
  return c


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
  """big_vision's `--config=file.py:a=1,b` convention: "k=v" pairs and bare flags (True).

  Values take the type of their default; unknown keys raise ValueError.
  """
  out = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, raw = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is not allowed; expected one of {sorted(defaults)}.")
    default = defaults[key]
    if not eq:
      value: Any = True
    elif isinstance(default, bool):
      if raw.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {key}={raw!r} is not allowed; expected true or false.")
      value = raw.lower() in ("true", "1")
    else:
      try:
        value = type(default)(raw)
      except ValueError:
        raise ValueError(f"config argument {key}={raw!r} is not allowed; expected a "
                         f"{type(default).__name__}.") from None
    out[key] = value
  return ml_collections.ConfigDict(out)


def grad_format(config: ml_collections.ConfigDict) -> FloatFormat | None:
  """The gradient all-reduce format, None for float32 (e8m23, as CPD's plain all-reduce)."""
  name = config.grad_format
  try:
    fmt = as_format(name)
  except ValueError as e:
    raise ValueError(f"config.grad_format={name!r} does not parse ({e}); expected a float "
                     "format name such as 'e4m3', 'e5m2', 'float8_e4m3fn' (grad_exp/grad_man "
                     "2..8 / 0..23).") from None
  if not isinstance(fmt, FloatFormat):
    raise ValueError(f"config.grad_format={name!r} is not allowed; expected a float format.")
  return None if (fmt.exp, fmt.man) == FLOAT32_EXP_MAN else fmt


def _grad_exp_man(config: ml_collections.ConfigDict) -> tuple[int, int]:
  """(exponent, mantissa) bits of config.grad_format (8, 23 for float32)."""
  fmt = grad_format(config)
  return FLOAT32_EXP_MAN if fmt is None else (fmt.exp, fmt.man)


def _check_grad_format(config: ml_collections.ConfigDict) -> None:
  """grad_format decides the all-reduce format. Unless it was set by name (it then differs from
  "e{grad_exp}m{grad_man}"), it is that reference; when it was, grad_exp / grad_man must be the
  defaults (8, 23: not set) or the format's own widths."""
  name = config.grad_format
  given = (config.grad_exp, config.grad_man)
  if name == f"e{given[0]}m{given[1]}" or given == FLOAT32_EXP_MAN:
    return
  exp, man = _grad_exp_man(config)
  if given != (exp, man):
    raise ValueError(
        f"config.grad_exp={given[0]!r}, config.grad_man={given[1]!r} are not allowed with "
        f"config.grad_format={name!r}; expected grad_exp={exp}, grad_man={man} (the format's "
        f"widths) or the defaults {FLOAT32_EXP_MAN[0]}, {FLOAT32_EXP_MAN[1]}: a grad_format set "
        "by name decides the all-reduce format (grad_exp / grad_man then change nothing), so "
        "set grad_format or grad_exp and grad_man, not both.")


def resolved(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config that runs, for the record (config.json, checkpoint metadata, and the config a
  resume compares): an unlocked copy of `config` with every FieldReference replaced by its value
  and grad_exp / grad_man set to grad_format's exponent and mantissa widths (float32: 8, 23), so
  that a grad_format set by name ("float8_e4m3fn") keeps its name and is recorded beside the
  widths that ran. `config` itself is not changed. Call it after `validate` (a grad_format that
  does not parse raises ValueError); `validate(resolved(c))` passes whenever `validate(c)` does,
  and resolved(resolved(c)) == resolved(c)."""
  out = config.copy_and_resolve_references()
  out.unlock()
  out.grad_exp, out.grad_man = _grad_exp_man(out)
  return out


def quant_rules(config: ml_collections.ConfigDict) -> list[Any]:
  """config.quant_rules as jlp.nn QuantRules (ValueError naming the bad rule)."""
  from jlp.gemm.config import GemmQuant  # pylint: disable=g-import-not-at-top
  from jlp.nn.rules import QuantRule  # pylint: disable=g-import-not-at-top
  out = []
  for i, rule in enumerate(config.quant_rules):
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ValueError(f"config.quant_rules[{i}]={rule!r} is not allowed; expected a pair "
                       "(module-path regex, {GemmQuant field: format}).")
    try:
      out.append(QuantRule(rule[0], GemmQuant.from_dict(dict(rule[1]))))
    except (ValueError, TypeError) as e:
      raise ValueError(f"config.quant_rules[{i}]={rule!r} is not allowed: {e}") from None
  return out


def quant_recipe(config: ml_collections.ConfigDict) -> str | None:
  """config.quant_recipe checked: the recipe's name, or None for "none" (ValueError naming the
  field: an unknown name, one not supported yet, or a recipe together with a BFP preset)."""
  from jlp.nn import recipes  # pylint: disable=g-import-not-at-top
  name = config.quant_recipe
  accumulator = config.get("quant_recipe_accumulator", True)
  _check(isinstance(accumulator, bool), "quant_recipe_accumulator", accumulator,
         "True (the recipe's accumulator model) or False (float32 GEMMs)")
  if name == "none":
    return None
  if name in recipes.UNSUPPORTED:
    raise ValueError(f"config.quant_recipe={name!r} is not supported yet: "
                     f"{recipes.UNSUPPORTED[name]}; expected one of "
                     f"{', '.join(repr(r) for r in ('none',) + recipes.RECIPES)}.")
  _check(name in recipes.RECIPES, "quant_recipe", name,
         f"one of {', '.join(repr(r) for r in ('none',) + recipes.RECIPES)}")
  bfp = config.bfp
  for field, value, off in (("bfp.preset", bfp.preset, ""), ("bfp.controller", bfp.controller, "")):
    _check(value == off, field, value, f"{off!r} with config.quant_recipe={name!r} (the recipe's "
           "catch-all rule would shadow the preset's rules)")
  _check(not dict(bfp.schedule), "bfp.schedule", dict(bfp.schedule),
         f"{{}} with config.quant_recipe={name!r} (the recipe's catch-all rule would shadow the "
         "presets' rules)")
  return name


def compressor(config: ml_collections.ConfigDict) -> Any:
  """The jlp.compression Compressor of config.compression (None for "none"); ValueError naming
  the field and the allowed values."""
  from jlp import compression  # pylint: disable=g-import-not-at-top
  c = config.compression
  names = ("none",) + tuple(sorted(compression.COMPRESSORS))
  _check(c.name in names, "compression.name", c.name, f"one of {names}")
  if c.name == "none":
    return None
  kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(c.kwargs).items()}
  try:
    return compression.get(c.name, **kwargs)
  except (ValueError, TypeError) as e:
    raise ValueError(f"config.compression.kwargs={kwargs!r} is not allowed for compressor "
                     f"{c.name!r}: {e}") from None


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
  if not ok:
    raise ValueError(f"config.{field}={value!r} is not allowed; expected {allowed}.")


def _int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks every field that can be checked without building anything (ValueError)."""
  from jlp import models  # pylint: disable=g-import-not-at-top
  from jlp.nn import controller as bfp_controller  # pylint: disable=g-import-not-at-top

  _check(config.task in TASKS, "task", config.task, f"one of {TASKS}")
  _check(config.model.name in models.MODELS, "model.name", config.model.name,
         f"one of {sorted(models.MODELS)}")
  for field in ("batch_size", "eval_batch_size", "max_steps", "log_every"):
    _check(_int(config[field]) and config[field] >= 1, field, config[field], "an int >= 1")
  for field in ("eval_every", "checkpoint_every"):
    _check(_int(config[field]) and config[field] >= 0, field, config[field], "an int >= 0 (0: off)")
  _check(_int(config.seed), "seed", config.seed, "an int")
  _check(isinstance(config.dataset.get("verify", False), bool), "dataset.verify",
         config.dataset.get("verify"), "True or False")
  workers = config.dataset.get("worker_processes", 0)
  _check(_int(workers) and workers >= 0, "dataset.worker_processes", workers,
         "an int >= 0 (0: threads of this process)")
  _check(isinstance(config.stop_at_accuracy, (int, float)) and 0 <= config.stop_at_accuracy <= 1,
         "stop_at_accuracy", config.stop_at_accuracy, "a fraction in [0, 1] (0: off)")
  if config.stop_at_accuracy:
    _check(config.task == "classification" and config.pipeline.schedule == "none",
           "stop_at_accuracy", config.stop_at_accuracy,
           "0 unless task='classification' with pipeline.schedule='none' (pipelined runs "
           "evaluate between calls and complete their mini-batches later)")
    _check(config.eval_every > 0, "stop_at_accuracy", config.stop_at_accuracy,
           "0 with eval_every=0 (the run stops at an evaluation, and there is none; set "
           "eval_every)")
  _check(config.lr >= 0, "lr", config.lr, "a learning rate >= 0")
  _check(0 <= config.momentum < 1, "momentum", config.momentum, "a value in [0, 1)")
  _check(config.optimizer in OPTIMIZERS, "optimizer", config.optimizer, f"one of {OPTIMIZERS}")
  _check(not (config.use_lars and config.optimizer != "sgd"), "use_lars", config.use_lars,
         "False with optimizer='adamw' (LARS is an SGD variant)")
  for field in ("adam_b1", "adam_b2"):
    _check(0 <= config[field] < 1, field, config[field], "a value in [0, 1)")
  _check(config.adam_eps > 0, "adam_eps", config.adam_eps, "a value > 0")
  if config.optimizer == "adamw":
    adamw = ("with optimizer='adamw' (momentum and nesterov are the SGD / LARS fields; "
             "adamw's first-moment decay is adam_b1)")
    _check(not config.nesterov, "nesterov", config.nesterov, f"False {adamw}")
    _check(config.momentum == SGD_MOMENTUM, "momentum", config.momentum,
           f"{SGD_MOMENTUM} (the default) {adamw}")
  else:
    for field, default in ADAM_DEFAULTS.items():
      _check(config[field] == default, field, config[field],
             f"{default!r} (the default) with optimizer={config.optimizer!r} (only "
             "optimizer='adamw' reads the adam_* fields)")
  _check(config.weight_decay >= 0, "weight_decay", config.weight_decay, "a value >= 0")
  try:
    re.compile(config.wd_exclude)
  except re.error as e:
    raise ValueError(f"config.wd_exclude={config.wd_exclude!r} is not a valid regex: {e}.") from None
  _check(config.loss_scale > 0, "loss_scale", config.loss_scale, "a value > 0")
  _check(isinstance(config.unscale_grads, bool), "unscale_grads", config.unscale_grads,
         "True or False")

  fmt = grad_format(config)
  _check_grad_format(config)
  _check(config.grad_algorithm in ALGORITHMS, "grad_algorithm", config.grad_algorithm,
         f"one of {ALGORITHMS}")
  _check(config.grad_algorithm != "psum" or (fmt is None and not config.use_kahan
                                              and config.emulate_nodes == 1),
         "grad_algorithm", config.grad_algorithm,
         "'sequential' or 'ring' with a low-precision format (grad_exp, grad_man), use_kahan or "
         "emulate_nodes > 1 ('psum' is XLA's float32 all-reduce of real devices)")
  _check(config.aps_mode in APS_MODES, "aps_mode", config.aps_mode, f"one of {APS_MODES}")
  _check(config.emulate_form in FORMS, "emulate_form", config.emulate_form, f"one of {FORMS}")
  _check(config.emulate_node_map in NODE_MAPS, "emulate_node_map", config.emulate_node_map,
         f"one of {NODE_MAPS}")
  _check(not (config.use_aps and fmt is None), "use_aps", config.use_aps,
         "False with a float32 all-reduce (grad_exp=8, grad_man=23): APS needs a low-precision format")
  _check(_int(config.emulate_nodes) and config.emulate_nodes >= 1, "emulate_nodes",
         config.emulate_nodes, "an int >= 1")
  _check(config.use_aps or config.aps_mode == "exact", "aps_mode", config.aps_mode,
         "'exact' (the default) with use_aps=False (aps_mode says how APS computes its "
         "exponents; set use_aps=True for APS)")
  _check(config.emulate_form == "flat" or config.emulate_nodes > 1
         or config.model.name == CAST_SINGLE_MODEL, "emulate_form", config.emulate_form,
         f"'flat' (the default) with emulate_nodes=1 (the two-level form reduces each device's "
         f"emulated nodes first; with one node it acts only on model {CAST_SINGLE_MODEL!r}, "
         "whose single local gradient CPD casts: jlp.sync.GradSync.cast_single)")

  _check_compression(config, fmt)
  _check_diloco(config, fmt)

  quant_rules(config)
  quant_recipe(config)
  if config.bfp.controller:
    bfp_controller.SimpleController.from_string(config.bfp.controller)  # raises on a bad string
  _check(_int(config.bfp.window) and config.bfp.window >= 0, "bfp.window", config.bfp.window,
         "an int >= 0 (0: one epoch)")
  _check(config.bfp.window == 0 or bool(config.bfp.controller), "bfp.window", config.bfp.window,
         "0 (the default) with bfp.controller='' (the window is the controller's)")
  for epoch in config.bfp.schedule:
    _check(str(epoch).isdigit(), "bfp.schedule", dict(config.bfp.schedule),
           "a mapping {epoch (int >= 0): preset name}")
  _check_pipeline(config, fmt)
  _check(not (config.bfp.preset and dict(config.bfp.schedule)), "bfp.preset", config.bfp.preset,
         f"'' with bfp.schedule={dict(config.bfp.schedule)!r} (the schedule decides the preset "
         "at every epoch); set a fixed preset with bfp.schedule={} (e.g. "
         "configs/bfp_resnet18_cifar100.py:preset=NAME)")


#: config.pipeline.sync values (jlp.pipeline.simulator.SYNC_MODES).
PIPELINE_SYNCS = ("allreduce", "none", "preduce", "adpsgd", "hetpipe")


def _number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_pipeline(config: ml_collections.ConfigDict, fmt: FloatFormat | None) -> None:
  """config.pipeline's device-independent checks (`pipeline_size` checks the rest)."""
  p = config.pipeline
  _check(p.schedule in PIPELINE_SCHEDULES, "pipeline.schedule", p.schedule,
         f"one of {PIPELINE_SCHEDULES}")
  if p.schedule == "none":
    for field, default in PIPELINE_DEFAULTS.items():
      value = p[field]
      _check(value == default or (isinstance(default, tuple) and tuple(value) == default),
             f"pipeline.{field}", value, f"{default!r} with pipeline.schedule='none' (set "
             "pipeline.schedule to 'gpipe' or '1f1b' to train pipelined)")
    return
  from jlp.nn import recipes  # pylint: disable=g-import-not-at-top
  if config.quant_recipe in recipes.STATEFUL:
    raise ValueError(f"config.quant_recipe={config.quant_recipe!r} is not allowed with "
                     f"pipeline.schedule={p.schedule!r}: its amax histories are updated by the "
                     "data-parallel step, so it is supported in data-parallel runs only "
                     "(pipeline.schedule='none').")
  from jlp.pipeline import stages as stage_rules  # pylint: disable=g-import-not-at-top
  zoo = sorted(n for rule in stage_rules.STAGE_RULES.values() for n in rule.zoo_names)
  _check(config.model.name in zoo, "model.name", config.model.name,
         f"a model with a pipeline stage rule with pipeline.schedule={p.schedule!r}: one of {zoo}")
  _check(config.task == "classification", "task", config.task,
         "'classification' with pipeline.schedule set (the last stage's loss is cross-entropy)")
  _check(_int(p.stages) and p.stages >= 1, "pipeline.stages", p.stages, "an int >= 1")
  _check(_int(p.pipelines) and p.pipelines >= 0, "pipeline.pipelines", p.pipelines,
         "an int >= 0 (0: every device, devices / pipeline.stages pipelines)")
  _check(_int(p.microbatches) and p.microbatches >= 1, "pipeline.microbatches", p.microbatches,
         "an int >= 1")
  _check(p.schedule != "1f1b" or p.microbatches == 1, "pipeline.microbatches", p.microbatches,
         "1 with pipeline.schedule='1f1b' (every mini-batch is its own update, docs/sdpipe.md)")
  _check(p.sync in PIPELINE_SYNCS, "pipeline.sync", p.sync, f"one of {PIPELINE_SYNCS}")
  _check(_int(p.virtual_stages) and p.virtual_stages >= 0, "pipeline.virtual_stages",
         p.virtual_stages, "an int >= 0 (0: the schedule's own)")
  _check(p.virtual_stages in (0, 1) or p.schedule == "interleaved_1f1b",
         "pipeline.virtual_stages", p.virtual_stages,
         f"0 with pipeline.schedule={p.schedule!r} (the schedule has its own; any v with "
         "'interleaved_1f1b')")
  _check(isinstance(p.schedule_csv, str) and bool(p.schedule_csv) == (p.schedule == "csv"),
         "pipeline.schedule_csv", p.schedule_csv,
         "the path of a torch compute-only CSV file with pipeline.schedule='csv', else ''")
  if p.schedule == "csv":
    _check(os.path.isfile(p.schedule_csv), "pipeline.schedule_csv", p.schedule_csv,
           "the path of an existing torch compute-only CSV file")
  if p.schedule in FLUSH_PIPELINE_SCHEDULES:
    flush = f"with pipeline.schedule={p.schedule!r} (the flush schedules run in lockstep)"
    _check(p.sync in ("allreduce", "none"), "pipeline.sync", p.sync,
           f"'allreduce' or 'none' {flush}")
    _check(p.hetero == 0, "pipeline.hetero", p.hetero, f"0 {flush}")
    _check(not tuple(p.slowdown), "pipeline.slowdown", p.slowdown, f"() {flush}")
  _check(_number(p.hetero) and p.hetero >= 0, "pipeline.hetero", p.hetero,
         "virtual seconds >= 0 (the seed's --hetero)")
  _check(_number(p.hetero_probability) and 0 <= p.hetero_probability <= 1,
         "pipeline.hetero_probability", p.hetero_probability, "a probability in [0, 1]")
  rows = p.slowdown
  ok = isinstance(rows, (tuple, list)) and all(
      isinstance(r, (tuple, list)) and len(r) == p.stages and all(_number(v) and v > 0 for v in r)
      for r in rows)
  _check(ok, "pipeline.slowdown", rows,
         f"() or [N][S] factors > 0 (one row of pipeline.stages={p.stages} per pipeline)")
  b = p.boundaries
  parts = pipeline_parts(config)
  ok = isinstance(b, (tuple, list)) and (
      len(b) == 0 or (len(b) == parts and all(_int(v) and v >= 1 for v in b)))
  _check(ok, "pipeline.boundaries", b,
         f"() (the stage rule's default) or {parts} unit counts >= 1 (one per part the model is "
         "split into: pipeline.stages x the stages per device)")
  for field, least in (("max_group", 0), ("connect_every", 1), ("pull_every", 1),
                       ("batches_per_call", 1)):
    _check(_int(p[field]) and p[field] >= least, f"pipeline.{field}", p[field],
           f"an int >= {least}" + (" (0: the number of pipelines)" if least == 0 else ""))
  _check(isinstance(p.barrier, bool), "pipeline.barrier", p.barrier, "True or False")
  for field in ("eval_every", "checkpoint_every"):
    _check(config[field] % p.batches_per_call == 0, field, config[field],
           f"a multiple of pipeline.batches_per_call={p.batches_per_call} (evaluation and "
           "checkpoints happen between Pipeline.run calls), or 0")

  pipelined = f"with pipeline.schedule={p.schedule!r}"
  _check(config.emulate_nodes == 1, "emulate_nodes", config.emulate_nodes,
         f"1 {pipelined} (a pipeline's devices are real mesh devices)")
  _check(config.emulate_form == "flat", "emulate_form", config.emulate_form, f"'flat' {pipelined}")
  _check(config.compression.plan == "", "compression.plan", config.compression.plan,
         f"'' {pipelined} (each stage's gradient is synchronised as one flat buffer, so per-leaf "
         "plans do not apply; compression.min_size applies to the stage's buffer)")
  _check(config.loss_scale == 1.0, "loss_scale", config.loss_scale,
         f"1.0 {pipelined} (the pipeline step has no loss scaling)")
  _check(config.unscale_grads, "unscale_grads", config.unscale_grads, f"True {pipelined}")
  _check(not dict(config.bfp.schedule), "bfp.schedule", dict(config.bfp.schedule),
         f"{{}} {pipelined}: preset switches are not supported in pipelines (a fixed "
         "bfp.preset is)")
  _check(not config.bfp.controller, "bfp.controller", config.bfp.controller,
         f"'' {pipelined}: the precision controller is not supported in pipelines")
  if p.sync != "allreduce":
    why = (f"with pipeline.sync={p.sync!r} (the gradient-sync fields set how "
           "pipeline.sync='allreduce' sums)")
    _check(fmt is None, "grad_format", config.grad_format, f"float32 (e8m23) {why}")
    _check(not config.use_aps, "use_aps", config.use_aps, f"False {why}")
    _check(not config.use_kahan, "use_kahan", config.use_kahan, f"False {why}")
    _check(config.grad_algorithm == "sequential", "grad_algorithm", config.grad_algorithm,
           f"'sequential' {why}")
    _check(config.compression.name == "none", "compression.name", config.compression.name,
           f"'none' {why}")


def pipeline_schedule(config: ml_collections.ConfigDict) -> Any:
  """What `jlp.pipeline.Pipeline(schedule=...)` takes for config.pipeline: the name, or the
  `jlp.pipeline.Schedule` of pipeline.schedule_csv (its per-device orders placed at ticks)."""
  p = config.pipeline
  if p.schedule != "csv":
    return p.schedule
  from jlp.pipeline import Schedule  # pylint: disable=g-import-not-at-top
  with open(p.schedule_csv) as f:
    text = f.read()
  try:
    table = Schedule.from_torch_csv(text)
    return Schedule.from_orders(table.orders()).validate()
  except ValueError as e:
    raise ValueError(f"config.pipeline.schedule_csv={p.schedule_csv!r} is not allowed: {e}") from e


def pipeline_parts(config: ml_collections.ConfigDict) -> int:
  """How many parts the model is split into: pipeline.stages devices x v stages per device."""
  p = config.pipeline
  if p.schedule == "csv":
    table = pipeline_schedule(config)
    _check(table.num_devices == p.stages, "pipeline.stages", p.stages,
           f"{table.num_devices}, the devices of pipeline.schedule_csv={p.schedule_csv!r}")
    return table.num_stages
  if p.schedule == "interleaved_1f1b":
    return p.stages * (p.virtual_stages or 2)
  return p.stages * (2 if p.schedule in ("zbv", "dualpipev") else 1)


def pipeline_size(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int]:
  """(N pipelines, S stages) of config.pipeline on `num_devices` devices, with the checks that
  need the device count (ValueError naming the field); after `validate`."""
  p = config.pipeline
  S = p.stages
  more = f" ({DEVICE_HINT})"
  if p.pipelines:
    N = p.pipelines
    _check(N * S <= num_devices, "pipeline.pipelines", N,
           f"at most {num_devices // S} pipelines of pipeline.stages={S} on {num_devices} "
           f"devices{more}")
  else:
    _check(num_devices % S == 0, "pipeline.stages", S,
           f"a divisor of the {num_devices} devices (N = devices / S pipelines), or set "
           f"pipeline.pipelines{more}")
    N = num_devices // S
  M = p.microbatches
  _check(config.batch_size % (N * M) == 0, "batch_size", config.batch_size,
         f"a multiple of {N} pipelines x pipeline.microbatches={M} = {N * M}")
  _check(config.eval_batch_size % num_devices == 0, "eval_batch_size", config.eval_batch_size,
         f"a multiple of {num_devices} devices (evaluation runs data-parallel on every device)")
  _check(len(p.slowdown) in (0, N), "pipeline.slowdown", p.slowdown,
         f"() or {N} rows (one per pipeline) of {S} factors")
  _check(p.max_group <= N, "pipeline.max_group", p.max_group, f"0 or at most the {N} pipelines")
  _check(p.sync != "adpsgd" or N % 2 == 0, "pipeline.sync", p.sync,
         f"not 'adpsgd' with an odd number of pipelines ({N}): AD-PSGD pairs them")
  return N, S


def _check_compression(config: ml_collections.ConfigDict, fmt: FloatFormat | None) -> None:
  c = config.compression
  codec = compressor(config)
  _check(c.topology in SYNC_TOPOLOGIES, "compression.topology", c.topology,
         f"one of {SYNC_TOPOLOGIES}")
  if codec is not None and c.topology not in type(codec).topologies:
    _check(False, "compression.topology", c.topology,
           f"one of {type(codec).topologies} with compression.name={c.name!r}")
  _check(_int(c.min_size) and c.min_size >= 0, "compression.min_size", c.min_size,
         "an int >= 0 (elements; 0 compresses every gradient)")
  plans = f"'', {SECOPA!r}, {AUTOTUNE!r} or the path of an existing SeCoPa plan file"
  _check(isinstance(c.plan, str), "compression.plan", c.plan, plans)
  if codec is None:
    off = "with compression.name='none' (no compressor: the CPD all-reduce sums every gradient)"
    for field, value, default in (("topology", c.topology, "ps"),
                                  ("min_size", c.min_size, DEFAULT_MIN_SIZE),
                                  ("kwargs", dict(c.kwargs), {}), ("plan", c.plan, ""),
                                  ("sync_fit", c.sync_fit, "")):
      _check(value == default, f"compression.{field}", value, f"{default!r} (the default) {off}")
    return
  _check(c.plan in ("", SECOPA, AUTOTUNE) or os.path.isfile(c.plan), "compression.plan", c.plan,
         plans)
  _check(isinstance(c.sync_fit, str) and (c.sync_fit == "" or (
      c.plan == AUTOTUNE and os.path.isfile(c.sync_fit))), "compression.sync_fit", c.sync_fit,
         f"'' or, with compression.plan={AUTOTUNE!r}, the path of an existing sync fit (JSON)")
  why = f"with config.compression.name={c.name!r} (the compressed sync sums float32 gradients)"
  _check(fmt is None, "grad_format", config.grad_format, f"float32 (grad_exp=8, grad_man=23) {why}")
  _check(not config.use_aps, "use_aps", config.use_aps, f"False {why}")
  _check(not config.use_kahan, "use_kahan", config.use_kahan, f"False {why}")
  _check(config.grad_algorithm == "sequential", "grad_algorithm", config.grad_algorithm,
         f"'sequential' {why}; its topology is config.compression.topology")
  _check(config.emulate_nodes == 1, "emulate_nodes", config.emulate_nodes,
         f"1 {why}: it runs between real devices, emulated nodes are not compressed")
  _check(config.emulate_form == "flat", "emulate_form", config.emulate_form,
         f"'flat' {why}: CPD's two-level form casts node gradients")


def _flat_diloco(d: Any, prefix: str = "diloco.") -> dict[str, Any]:
  out = {}
  for key, value in d.items():
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      out.update(_flat_diloco(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _check_diloco(config: ml_collections.ConfigDict, fmt: FloatFormat | None) -> None:
  """config.diloco's checks (module docstring); the fragment count against the model's leaves
  is checked when the model exists (jlp.train.recipe.diloco)."""
  d = config.get("diloco")
  if d is None:  # a config written before the diloco fields
    return
  _check(_int(d.period) and d.period >= 0, "diloco.period", d.period,
         "an int >= 0 (inner steps per outer step; 0: off)")
  if d.period == 0:
    given = _flat_diloco(d)
    for field, default in _flat_diloco(DILOCO_DEFAULTS).items():
      if field == "diloco.period":
        continue
      _check(given.get(field) == default, field, given.get(field),
             f"{default!r} (the default) with diloco.period=0 (DiLoCo is off; set diloco.period "
             "to train with it)")
    return
  h = d.period
  _check(_int(d.fragments) and 1 <= d.fragments <= h, "diloco.fragments", d.fragments,
         f"an int with 1 <= fragments <= diloco.period={h}")
  _check(_int(d.overlap) and 0 <= d.overlap < h, "diloco.overlap", d.overlap,
         f"an int with 0 <= overlap < diloco.period={h}")
  _check(_number(d.alpha) and 0 <= d.alpha <= 1, "diloco.alpha", d.alpha, "a float in [0, 1]")
  _check(isinstance(d.average_state, bool), "diloco.average_state", d.average_state,
         "True or False")
  o = d.outer_optimizer
  _check(o.name in OUTER_OPTIMIZERS, "diloco.outer_optimizer.name", o.name,
         f"one of {OUTER_OPTIMIZERS}")
  _check(_number(o.lr) and o.lr >= 0, "diloco.outer_optimizer.lr", o.lr, "a learning rate >= 0")
  _check(_number(o.momentum) and 0 <= o.momentum < 1, "diloco.outer_optimizer.momentum",
         o.momentum, "a value in [0, 1)")
  _check(isinstance(o.nesterov, bool), "diloco.outer_optimizer.nesterov", o.nesterov,
         "True or False")
  _check(not (o.nesterov and o.momentum == 0), "diloco.outer_optimizer.nesterov", o.nesterov,
         "False with diloco.outer_optimizer.momentum=0 (Nesterov needs momentum)")
  _check(isinstance(d.outer_format, str), "diloco.outer_format", d.outer_format,
         "'' or a float format name of at most 8 bits")
  if d.outer_format:
    try:
      ofmt = as_format(d.outer_format)
    except ValueError:
      ofmt = None
    _check(isinstance(ofmt, FloatFormat) and ofmt.bits <= 8 and ofmt.compat is None
           and ofmt.rounding != "stochastic", "diloco.outer_format", d.outer_format,
           "'' or a float format of at most 8 bits, without compat, not stochastic "
           "(e.g. 'e2m1', 'e3m0', 'e4m3')")
    why = (f"with diloco.outer_format={d.outer_format!r} (the outer gradients cross as its "
           "codes; the gradient-sync fields set the other outer sync)")
    _check(fmt is None, "grad_format", config.grad_format, f"float32 (e8m23) {why}")
    _check(not config.use_aps, "use_aps", config.use_aps, f"False {why}")
    _check(not config.use_kahan, "use_kahan", config.use_kahan, f"False {why}")
    _check(config.grad_algorithm == "sequential", "grad_algorithm", config.grad_algorithm,
           f"'sequential' {why}")
  on = f"with diloco.period={h} (DiLoCo replaces the data-parallel step)"
  _check(config.pipeline.schedule == "none", "pipeline.schedule", config.pipeline.schedule,
         f"'none' {on}")
  _check(config.compression.name == "none", "compression.name", config.compression.name,
         f"'none' {on}: its outer sync takes no compressor (the gradient-sync fields and "
         "diloco.outer_format set how the outer gradients cross)")
  _check(config.emulate_nodes == 1, "emulate_nodes", config.emulate_nodes,
         f"1 {on}: its replicas are the devices")
  _check(not dict(config.bfp.schedule), "bfp.schedule", dict(config.bfp.schedule),
         f"{{}} {on}: preset switches are not supported (a fixed bfp.preset is)")
  _check(not config.bfp.controller, "bfp.controller", config.bfp.controller,
         f"'' {on}: the precision controller reads the data-parallel step's gradients")
  from jlp.nn import recipes  # pylint: disable=g-import-not-at-top
  _check(config.quant_recipe not in recipes.STATEFUL, "quant_recipe", config.quant_recipe,
         f"a recipe without per-step state {on} (its amax histories are updated by the "
         "data-parallel step)")
