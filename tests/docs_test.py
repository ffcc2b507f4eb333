"""The README and docs/ stand alone: no citations of private spec files, every relative link
resolves, every command of the README and the docs pages names its Python, and the tour's SeCoPa
recipe gives the names the runner's plans use."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Spec files that lived outside the repository; only docs/<name>.md pages that exist may be named.
SPEC_NAMES = ("cpd", "bfp", "hipress", "sdpipe", "peers", "toolchain")
#: Where users read: the tests (tests/) may keep citing the specs.
CHECKED = ("README.md", "BENCHMARKS.md", "docs", "jlp", "experiments", "configs", "pallas_kernels",
           "benchmarks", "notebooks")
TEXT_SUFFIXES = (".py", ".md", ".ipynb", ".txt", ".cfg", ".toml", ".json", ".yaml", ".yml")
MENTION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*(?:%s)\.md)(#[\w-]+)?" % "|".join(SPEC_NAMES))
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def checked_files():
  for entry in CHECKED:
    path = os.path.join(ROOT, entry)
    if os.path.isfile(path):
      yield path
      continue
    for dirpath, dirnames, filenames in os.walk(path):
      dirnames[:] = [d for d in dirnames
                     if not d.startswith(".") and d not in ("__pycache__", "_build")]
      for name in sorted(filenames):
        if name.endswith(TEXT_SUFFIXES):
          yield os.path.join(dirpath, name)


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: links and code marks dropped, lower case, punctuation other
  than '-' and '_' removed, spaces to '-'."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md_path: str) -> set[str]:
  out, seen = set(), {}
  in_code = False
  with open(md_path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("```"):
        in_code = not in_code
      m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
      if m:
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
  return out


def broken_target(source: str, target: str) -> str | None:
  """Why a relative link `target` in file `source` is broken, or None. Paths are tried relative
  to the file's folder and to the repository root (docstrings cite "docs/cpd.md#aps")."""
  path, _, anchor = target.partition("#")
  if path:
    candidates = [os.path.normpath(os.path.join(os.path.dirname(source), path)),
                  os.path.normpath(os.path.join(ROOT, path))]
    found = [c for c in candidates if os.path.exists(c)]
    if not found:
      return f"{path} does not exist"
    path = found[0]
  else:
    path = source
  if anchor and path.endswith(".md") and anchor not in anchors(path):
    return f"{os.path.relpath(path, ROOT)} has no heading #{anchor}"
  return None


def test_no_private_spec_citations():
  """cpd.md, bfp.md, hipress.md, sdpipe.md, peers.md and toolchain.md were private notes users
  never see: user-facing files may name them only as links to docs/<name>.md pages that exist
  (with an existing #anchor)."""
  docs = os.path.join(ROOT, "docs")
  offending = []
  for path in checked_files():
    with open(path, encoding="utf-8", errors="replace") as f:
      for number, line in enumerate(f, 1):
        for m in MENTION.finditer(line):
          mention, anchor = m.group(1), m.group(2) or ""
          name = os.path.basename(mention)
          candidates = {os.path.normpath(os.path.join(ROOT, mention)),
                        os.path.normpath(os.path.join(os.path.dirname(path), mention))}
          target = os.path.join(docs, name)
          why = None
          if target not in candidates:
            why = "not a docs/ page"
          elif not os.path.isfile(target):
            why = f"docs/{name} does not exist"
          elif anchor and anchor[1:] not in anchors(target):
            why = f"docs/{name} has no heading {anchor}"
          if why:
            offending.append(f"{os.path.relpath(path, ROOT)}:{number}: {m.group(0)} ({why})")
  assert not offending, ("private spec citations (cite the paper, or link docs/<name>.md#anchor):\n"
                         + "\n".join(offending))


def markdown_files():
  yield os.path.join(ROOT, "README.md")
  yield os.path.join(ROOT, "BENCHMARKS.md")
  yield os.path.join(ROOT, "notebooks", "README.md")
  for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "docs")):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))  # not _build
    yield from (os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".md"))


def without_code(text: str) -> str:
  """Markdown text with fenced blocks and inline code blanked (line numbers kept)."""
  text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
  return re.sub(r"`[^`\n]*`", "", text)


def test_relative_links_resolve():
  """Every relative link of README.md, BENCHMARKS.md, notebooks/README.md and docs/**/*.md names
  a file that exists, and a heading of it when it has an #anchor."""
  broken = []
  for path in markdown_files():
    with open(path, encoding="utf-8") as f:
      text = without_code(f.read())
    for number, line in enumerate(text.splitlines(), 1):
      for m in LINK.finditer(line):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
          continue
        why = broken_target(path, target)
        if why:
          broken.append(f"{os.path.relpath(path, ROOT)}:{number}: {m.group(0)} ({why})")
  assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_docs_pages_cover_every_system():
  for name in ("cpd", "bfp", "hipress", "sdpipe"):
    page = os.path.join(ROOT, "docs", f"{name}.md")
    assert os.path.isfile(page), page
    assert "compat-switches" in anchors(page), f"docs/{name}.md lacks its '## Compat switches'"


def user_pages():
  """README.md and the site's Markdown pages, where users copy commands from."""
  yield os.path.join(ROOT, "README.md")
  for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "docs")):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
    yield from (os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".md"))


@pytest.mark.parametrize("page", [os.path.relpath(p, ROOT) for p in user_pages()])
def test_readme_commands_name_their_python(page):
  """A command of README.md or a docs page that runs Python runs .venv/bin/python, or its code
  block follows a line that says to activate the environment first (`source .venv/bin/activate`)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = f.read().splitlines()
  bare = re.compile(r"(?<![\w/.-])python3?(\.\d+)? +(-m|\S+\.py)\b")
  offending, in_block, activated, previous = [], None, False, []
  for number, line in enumerate(lines, 1):
    if line.startswith("```"):
      if in_block is None:
        in_block = line[3:].strip()
        activated = any("source .venv/bin/activate" in p for p in previous[-3:])
      else:
        in_block = None
      continue
    if in_block == "python":  # Python source, not a command
      continue
    if in_block is not None and activated:
      continue
    if line.strip() and in_block is None:
      previous.append(line)  # the lines of text just before the next block
    for m in bare.finditer(line):
      offending.append(f"{page}:{number}: {line.strip()}")
  assert not offending, ("commands that do not say which Python (write .venv/bin/python, "
                         "or say to activate the venv before the block):\n" + "\n".join(offending))


def test_readme_secopa_names_are_the_runners(tmp_path, monkeypatch):
  """The tour's recipe for SeCoPa's input.txt (docs/tour.md, once the README's) writes the names
  `--config.compression.plan` files use: jax.tree_util.keystr of the parameter paths, as
  `plan_for_tree` keys them."""
  import jax  # pylint: disable=g-import-not-at-top
  import jlp.models  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jlp.compression import secopa  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, "docs", "tour.md"), encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("**SeCoPa's files.**"):]
  snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
  monkeypatch.chdir(tmp_path)
  exec(compile(snippet, "docs/tour.md (SeCoPa's files)", "exec"), {})  # pylint: disable=exec-used
  grads = secopa.read_grads(tmp_path / "input.txt")
  model = nnx.eval_shape(lambda: jlp.models.get_model("small_cnn", num_classes=10,
                                                      rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  plan = secopa.plan_for_tree(params, num_nodes=8, topology="ring")
  assert [name for name, _ in grads] == list(plan)
  assert ("['conv2']['kernel'].value", 4608) in grads
  assert all(size == math_prod for (_, size), math_prod in
             zip(grads, (x.size for x in jax.tree.leaves(params))))


@pytest.mark.parametrize("page,phrase", [
    ("experiments.md", "Why `wire_bytes` is 0 on one device"),
    ("experiments.md", "--cpu_devices=N"),
    ("setup.md", "python -m experiments.cluster"),
    ("cluster.md", "python -m experiments.cluster")])
def test_docs_explain_devices(page, phrase):
  """The site says how many devices a run sees (the README's "Devices", moved to the
  experiments page), and how to give hosts a real network."""
  with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
    assert phrase in " ".join(f.read().split())


#: The README's two set-up commands, exactly as users copy them.
SETUP_COMMANDS = (
    "make demo   # creates .venv (Python 3.12), pip install -e '.[dev]', runs the main job "
    "(~25 s idle, ~3 min under load)",
    "make test   # the same set-up, then the default test suite (what CI runs)")


def test_readme_is_a_landing_page():
  """README.md is a landing page of at most 250 lines with the two set-up commands in its first
  60; the long sections live on the site (docs/)."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
  for command in SETUP_COMMANDS:
    assert command in lines[:60], f"not in README.md's first 60 lines: {command}"
  with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
    targets = set(re.findall(r"^([\w-]+):", f.read(), flags=re.M))
  assert {"demo", "test", "docs"} <= targets
