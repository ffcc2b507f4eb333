"""jlp.train.config's refusals of fields that would do nothing (issue 32 §7), and `resolved`.

* Every field that is read only together with another one (compression.* with a compressor,
  aps_mode with use_aps, emulate_form with emulated nodes, bfp.window with a controller, the SGD
  and Adam fields with their optimizer, stop_at_accuracy with evaluations, bfp.preset without a
  schedule) is refused with a ValueError naming the field, the value and what is allowed when
  set without it; the same value with the field it needs passes.
* grad_format decides the all-reduce format: `--config.grad_format=NAME` on the command line
  (ml_collections' override, parsed here with config_flags) unlinks it from grad_exp/grad_man,
  grad_exp/grad_man that disagree with it are refused, and `resolved` records the widths that run.
* configs/bfp_resnet18_cifar100.py: the schedule alone; `:preset=NAME` a fixed preset instead.
"""

import importlib
import json
import os
import re

import pytest
from absl import flags
from ml_collections import config_flags

from jlp.formats import as_format
from jlp.train import config as config_lib
from jlp.train import recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _config(**fields):
  """base_config() with each "a.b"-style field set."""
  c = config_lib.base_config()
  for path, value in fields.items():
    *parents, leaf = path.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


E4M3_APS = {"grad_exp": 4, "grad_man": 3, "use_aps": True}

# (fields, the message's pattern, the same value with what makes it act: passes validation)
INERT = [
    ({"compression.kwargs": {"threshold": 2.0}},
     r"config.compression.kwargs=\{'threshold': 2.0\} is not allowed; expected \{\} \(the "
     r"default\) with compression.name='none'",
     {"compression.name": "tbq"}),
    ({"compression.topology": "ring"},
     r"config.compression.topology='ring' is not allowed; expected 'ps' \(the default\) with "
     r"compression.name='none'", {"compression.name": "onebit"}),
    ({"compression.plan": "/nonexistent"},
     r"config.compression.plan='/nonexistent' is not allowed; expected '' \(the default\) with "
     r"compression.name='none'", None),
    ({"compression.plan": "secopa"}, r"config.compression.plan='secopa' is not allowed",
     {"compression.name": "onebit"}),
    ({"compression.min_size": 0},
     r"config.compression.min_size=0 is not allowed; expected 262144 \(the default\) with "
     r"compression.name='none'", {"compression.name": "onebit"}),
    ({"aps_mode": "cpd", "grad_exp": 4, "grad_man": 3},
     r"config.aps_mode='cpd' is not allowed; expected 'exact' \(the default\) with use_aps=False",
     {"use_aps": True}),
    ({"emulate_form": "cpd"},
     r"config.emulate_form='cpd' is not allowed; expected 'flat' \(the default\) with "
     r"emulate_nodes=1", {"emulate_nodes": 2}),
    ({"bfp.window": 3},
     r"config.bfp.window=3 is not allowed; expected 0 \(the default\) with bfp.controller=''",
     {"bfp.controller": "Simple/0.1/0.3/0/1", "bfp.preset": "default_FB12"}),
    ({"optimizer": "adamw", "nesterov": True},
     r"config.nesterov=True is not allowed; expected False with optimizer='adamw'",
     {"optimizer": "sgd"}),
    ({"optimizer": "adamw", "momentum": 0.5},
     r"config.momentum=0.5 is not allowed; expected 0.9 \(the default\) with optimizer='adamw'",
     {"optimizer": "sgd"}),
    ({"adam_b1": 0.8}, r"config.adam_b1=0.8 is not allowed; expected 0.9 \(the default\) with "
     r"optimizer='sgd'", {"optimizer": "adamw"}),
    ({"adam_b2": 0.99}, r"config.adam_b2=0.99 is not allowed; expected 0.999",
     {"optimizer": "adamw"}),
    ({"adam_eps": 1e-6}, r"config.adam_eps=1e-06 is not allowed; expected 1e-08",
     {"optimizer": "adamw"}),
    ({"adam_eps": 1e-6, "use_lars": True}, r"config.adam_eps=1e-06 is not allowed", None),
    ({"grad_algorithm": "psum", "grad_exp": 5, "grad_man": 2},
     r"config.grad_algorithm='psum' is not allowed; expected 'sequential' or 'ring' with a "
     r"low-precision format", {"grad_exp": 8, "grad_man": 23}),
    ({"grad_algorithm": "psum", "emulate_nodes": 2},
     r"config.grad_algorithm='psum' is not allowed", {"emulate_nodes": 1}),
    ({"stop_at_accuracy": 0.9, "eval_every": 0},
     r"config.stop_at_accuracy=0.9 is not allowed; expected 0 with eval_every=0",
     {"eval_every": 10}),
    ({"bfp.preset": "default_FB12", "bfp.schedule": {"0": "default_FB16", "1": "default_FB12"}},
     r"config.bfp.preset='default_FB12' is not allowed; expected '' with bfp.schedule=\{'0': "
     r"'default_FB16', '1': 'default_FB12'\} \(the schedule decides the preset",
     {"bfp.schedule": {}}),
]


@pytest.mark.parametrize("fields, message, needs", INERT)
def test_a_field_that_would_do_nothing_is_refused(fields, message, needs):
  with pytest.raises(ValueError, match=message):
    config_lib.validate(_config(**fields))
  if needs is not None:  # with what it needs, the same value passes
    config_lib.validate(_config(**{**fields, **needs}))


def test_fields_that_act_with_one_node_are_accepted():
  """emulate_form="cpd" on resnet50 casts its single local gradient (GradSync.cast_single), and
  emulate_node_map runs the one-node program unrolled, in a one-trip loop or vmapped (the last
  bits differ): both act with emulate_nodes=1, so both are accepted."""
  c = _config(**{"model.name": "resnet50", "emulate_form": "cpd", **E4M3_APS})
  config_lib.validate(c)
  assert recipe.grad_sync(c).uses_emulation
  for node_map in config_lib.NODE_MAPS:
    config_lib.validate(_config(emulate_node_map=node_map))


def test_defaults_and_the_lars_fields_pass():
  config_lib.validate(config_lib.base_config())
  config_lib.validate(_config(use_lars=True, nesterov=True, wd_exclude="bn|bias",
                              weight_decay=1e-4))


def _parse(*args):
  """The config experiments.train gets from `--config=configs/digits.py ARGS` (config_flags)."""
  argv = ["train", f"--config={os.path.join(ROOT, 'configs', 'digits.py')}", *args]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True,
                                  sys_argv=argv)
  values(argv)
  return values.config


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # config_flags' loader
def test_grad_format_by_name_decides_and_the_record_says_what_ran():
  # grad_exp / grad_man alone: grad_format follows them (the reference stays linked).
  c = _parse("--config.grad_exp=4", "--config.grad_man=3")
  assert c.grad_format == "e4m3"
  config_lib.validate(c)
  assert config_lib.resolved(c).to_dict() == c.to_dict()
  # An override of grad_format unlinks it whatever the order: grad_exp / grad_man stay as given.
  for args in (("--config.grad_format=float8_e4m3fn", "--config.grad_exp=5"),
               ("--config.grad_exp=5", "--config.grad_format=float8_e4m3fn")):
    c = _parse(*args)
    assert (c.grad_format, c.grad_exp, c.grad_man) == ("float8_e4m3fn", 5, 23)
    with pytest.raises(ValueError, match=re.escape(
        "config.grad_exp=5, config.grad_man=23 are not allowed with "
        "config.grad_format='float8_e4m3fn'; expected grad_exp=4, grad_man=3 (the format's "
        "widths) or the defaults 8, 23")):
      config_lib.validate(c)
  # By name alone (grad_exp / grad_man at their defaults): it runs, and the record says so.
  c = _parse("--config.grad_format=float8_e4m3fn")
  config_lib.validate(c)
  assert config_lib.grad_format(c) == as_format("float8_e4m3fn")  # not e4m3: the name decides
  record = config_lib.resolved(c)
  assert (record.grad_format, record.grad_exp, record.grad_man) == ("float8_e4m3fn", 4, 3)
  assert json.loads(record.to_json_best_effort())["grad_exp"] == 4
  assert (c.grad_exp, c.grad_man) == (8, 23) and c.is_locked  # the config itself is unchanged
  assert not record.is_locked
  config_lib.validate(record)
  assert config_lib.resolved(record).to_dict() == record.to_dict()
  # By name, agreeing with grad_exp / grad_man: accepted.
  config_lib.validate(_parse("--config.grad_format=e5m2", "--config.grad_exp=5",
                             "--config.grad_man=2"))
  # A float32 format by name: the widths are float32's.
  record = config_lib.resolved(_parse("--config.grad_format=e8m23"))
  assert (record.grad_exp, record.grad_man) == (8, 23)


def test_resolved_resolves_references():
  c = importlib.import_module("configs.hipress_bert_small").get_config()
  record = config_lib.resolved(c)
  record.model.kwargs.max_len = 64  # a plain copy: the dataset's max_len no longer follows
  assert record.dataset.kwargs.max_len == 128 and c.dataset.kwargs.max_len == 128


def test_bfp_recipe_sets_the_schedule_and_its_preset_argument_a_fixed_preset():
  module = importlib.import_module("configs.bfp_resnet18_cifar100")
  for local in ("", ",local"):
    c = module.get_config(local.lstrip(","))
    config_lib.validate(c)
    assert c.bfp.preset == "" and dict(c.bfp.schedule)["0"] == "ResNet18_FB16"
    c.bfp.preset = "ResNet18_FB12"  # --config.bfp.preset=...: the schedule would decide
    with pytest.raises(ValueError, match="config.bfp.preset='ResNet18_FB12' is not allowed"):
      config_lib.validate(c)
    c = module.get_config(f"preset=ResNet18_FB12{local}")
    config_lib.validate(c)
    assert c.bfp.preset == "ResNet18_FB12" and dict(c.bfp.schedule) == {}
