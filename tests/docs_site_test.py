"""The documentation site (`make docs`, docs/conf.py): its API reference covers the public API, and
the site builds without warnings.

Fast (default tier): every public name (each module's `__all__`; for `jlp.gemm` the names its
package binds; for `jlp.numerics` its submodules) has a docstring and an autodoc/autosummary
entry in docs/api/, every notebook is a page, and every page is reachable from a toctree. (The
local links of docs/**/*.md and README.md are checked by tests/docs_test.py.)

Slow (`make test-slow`): the Sphinx build with -W in a temporary folder (about a minute); the API
pages hold the docstrings of jlp.FloatFormat, jlp.quantize, jlp.compression.sync,
jlp.sync.GradSync and jlp.pipeline.Pipeline, and every local link of the built HTML resolves to a
file and, with a #fragment, to an element id of it."""

import dataclasses
import html.parser
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
API = os.path.join(DOCS, "api")

#: The modules whose public API the site documents, one page each (docs/api/<module>.md).
PUBLIC_MODULES = ("jlp", "jlp.formats", "jlp.numerics", "jlp.gemm", "jlp.nn", "jlp.collectives",
                  "jlp.compression", "jlp.sync", "jlp.sync_tuning", "jlp.pipeline", "jlp.train",
                  "jlp.data", "jlp.models")
#: The docstrings the issue names: the built API pages must hold each.
NAMED = ("jlp.FloatFormat", "jlp.quantize", "jlp.compression.sync", "jlp.sync.GradSync",
         "jlp.pipeline.Pipeline")


def public_names(module_name: str) -> list[str]:
  """The module's `__all__`; without one, the non-module names its package binds (jlp.gemm), or
  its submodules (jlp.numerics, whose package binds nothing)."""
  module = importlib.import_module(module_name)
  if hasattr(module, "__all__"):
    return list(module.__all__)
  names = sorted(n for n, o in vars(module).items()
                 if not n.startswith("_") and not inspect.ismodule(o))
  if names:
    return names
  return sorted(m.name for m in pkgutil.iter_modules(module.__path__))


def public_object(module_name: str, name: str):
  module = importlib.import_module(module_name)
  if hasattr(module, name):
    return getattr(module, name)
  return importlib.import_module(f"{module_name}.{name}")


def own_docstring(obj) -> str:
  """obj's own docstring: not inherited, and not the signature a dataclass writes when its class
  has none."""
  doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
  doc = (doc or "").strip()
  if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
    try:
      generated = obj.__name__ + str(inspect.signature(obj)).replace(" -> None", "")
    except (TypeError, ValueError):
      generated = None
    if doc == generated:
      return ""
  return doc


def documentable(obj) -> bool:
  """Classes, functions and modules carry docstrings; constants and type aliases do not."""
  return inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_have_docstrings(module_name):
  module = importlib.import_module(module_name)
  assert own_docstring(module), f"{module_name} has no module docstring"
  missing = [name for name in public_names(module_name)
             if documentable(public_object(module_name, name))
             and not own_docstring(public_object(module_name, name))]
  assert not missing, f"public names of {module_name} without a docstring: {missing}"


def rst_blocks(text: str) -> list[str]:
  return re.findall(r"^```\{eval-rst\}\n(.*?)^```", text, flags=re.S | re.M)


def api_entries(path: str) -> set[str]:
  """The fully qualified names that docs/api page `path` documents: automodule, autoclass,
  autofunction, autodata, ... directives and autosummary items, each resolved against the
  current module (set by automodule and currentmodule) as Sphinx resolves it."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  entries, current, in_summary = set(), None, False
  for block in rst_blocks(text):
    for line in block.splitlines():
      m = re.match(r"\.\. (auto\w+|currentmodule)::\s*(\S+)", line)
      if m:
        kind, target = m.groups()
        in_summary = kind == "autosummary"
        if kind in ("automodule", "currentmodule"):
          current = target
        if kind not in ("currentmodule", "autosummary"):
          entries.add(target if kind == "automodule" or current is None else f"{current}.{target}")
        continue
      if in_summary:
        item = re.match(r"   ([\w.]+)\s*$", line)
        if item:
          name = item.group(1)
          entries.add(name if current is None or name.startswith(current + ".")
                      else f"{current}.{name}")
        elif line.strip() and not line.startswith("   :"):
          in_summary = False
  return entries


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_have_api_entries(module_name):
  """docs/api/<module>.md names every public name in its autosummary table and in an autodoc
  directive (the two entries point at the same names)."""
  path = os.path.join(API, f"{module_name}.md")
  assert os.path.isfile(path), f"no API page {os.path.relpath(path, ROOT)}"
  entries = api_entries(path)
  assert module_name in entries, f"{os.path.relpath(path, ROOT)} has no automodule:: {module_name}"
  missing = [n for n in public_names(module_name) if f"{module_name}.{n}" not in entries]
  assert not missing, (f"public names of {module_name} without an entry in "
                       f"{os.path.relpath(path, ROOT)}: {missing}")


def test_api_index_lists_every_module_page():
  with open(os.path.join(API, "index.md"), encoding="utf-8") as f:
    toctree = re.search(r"```\{toctree\}\n(.*?)```", f.read(), flags=re.S).group(1)
  listed = {line.strip() for line in toctree.splitlines() if line.strip()
            and not line.startswith(":")}
  assert listed == set(PUBLIC_MODULES)


def test_every_notebook_is_a_page():
  """Each notebooks/*.ipynb is linked into docs/notebooks/ (the site renders it from its stored
  outputs) and listed in that folder's toctree."""
  notebooks = sorted(n for n in os.listdir(os.path.join(ROOT, "notebooks"))
                     if n.endswith(".ipynb"))
  assert notebooks
  with open(os.path.join(DOCS, "notebooks", "index.md"), encoding="utf-8") as f:
    index = f.read()
  for name in notebooks:
    link = os.path.join(DOCS, "notebooks", name)
    assert os.path.exists(link), f"docs/notebooks/{name} is missing (a symbolic link to it)"
    assert os.path.samefile(link, os.path.join(ROOT, "notebooks", name)), link
    assert re.search(rf"^{re.escape(name[:-len('.ipynb')])}$", index, flags=re.M), (
        f"docs/notebooks/index.md does not list {name}")


def test_site_configuration_never_executes_notebooks():
  with open(os.path.join(DOCS, "conf.py"), encoding="utf-8") as f:
    conf = f.read()
  assert re.search(r'^nb_execution_mode = "off"$', conf, flags=re.M)


def toctree_entries(path: str) -> set[str]:
  with open(path, encoding="utf-8") as f:
    text = f.read()
  folder = os.path.relpath(os.path.dirname(path), DOCS)
  out = set()
  for block in re.findall(r"```\{toctree\}\n(.*?)```", text, flags=re.S):
    for line in block.splitlines():
      if line.strip() and not line.startswith(":"):
        out.add(os.path.normpath(os.path.join(folder, line.strip())))
  return out


def test_every_page_is_in_a_toctree():
  """Every page of docs/ (Markdown and notebooks) is reachable from the home page."""
  pages, listed = set(), set()
  for dirpath, dirnames, filenames in os.walk(DOCS):
    dirnames[:] = [d for d in dirnames if not d.startswith(("_", "."))]
    for name in filenames:
      stem, ext = os.path.splitext(name)
      if ext in (".md", ".ipynb"):
        page = os.path.normpath(os.path.relpath(os.path.join(dirpath, stem), DOCS))
        pages.add(page)
        if ext == ".md":
          listed |= toctree_entries(os.path.join(dirpath, name))
  assert "index" in pages
  assert not pages - listed - {"index"}, f"pages in no toctree: {sorted(pages - listed)}"


# --- The build (slow tier) ----------------------------------------------------------------------


class _Page(html.parser.HTMLParser):
  """The ids and the local links of one HTML page, and its text."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.ids, self.links, self.text = set(), [], []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if attrs.get("id"):
      self.ids.add(attrs["id"])
    if tag == "a" and attrs.get("name"):
      self.ids.add(attrs["name"])
    for key in ("href", "src"):
      value = attrs.get(key)
      if value and not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", value):
        self.links.append(value)

  def handle_data(self, data):
    self.text.append(data)


def _parse(path: str) -> _Page:
  page = _Page()
  with open(path, encoding="utf-8") as f:
    page.feed(f.read())
  return page


def _words(text: str) -> str:
  return " ".join(text.replace("`", "").split())


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  pytest.importorskip("sphinx", reason="needs the docs extra (make docs installs it)")
  pytest.importorskip("myst_nb", reason="needs the docs extra (make docs installs it)")
  out = tmp_path_factory.mktemp("site")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(out / "doctrees"), DOCS, str(out / "html")],
      capture_output=True, text=True, timeout=900, cwd=ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
  assert not proc.stderr.strip(), f"sphinx-build warned:\n{proc.stderr}"
  return out / "html"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMED)
def test_site_api_pages_hold_the_docstrings(site, name):
  """The API page of `name`'s module holds its whole docstring (whitespace and backticks aside)."""
  module_name, _, attr = name.rpartition(".")
  obj = getattr(importlib.import_module(module_name), attr)
  page = _parse(os.path.join(site, "api", f"{module_name}.html"))
  assert f"{name}" in page.ids, f"api/{module_name}.html has no entry #{name}"
  text = _words("".join(page.text))
  for paragraph in inspect.cleandoc(obj.__doc__).split("\n\n"):
    assert _words(paragraph) in text, f"{name}: not on api/{module_name}.html:\n{paragraph}"


@pytest.mark.slow
def test_site_local_links_resolve(site):
  """Every href and src of every built page that is not a URL names a file of the site, and its
  #fragment an id of that file."""
  pages = {}
  for dirpath, dirnames, filenames in os.walk(site):
    dirnames[:] = [d for d in dirnames if d != "_static"]  # the themes' template fragments
    for name in filenames:
      if name.endswith(".html"):
        pages[os.path.join(dirpath, name)] = None
  broken = []
  for path in sorted(pages):
    for link in _parse(path).links:
      target, _, fragment = link.partition("#")
      target = urllib.parse.unquote(target.split("?")[0])
      resolved = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
      if not os.path.exists(resolved):
        broken.append(f"{os.path.relpath(path, site)}: {link} (no file)")
        continue
      if fragment and resolved.endswith(".html"):
        if pages.get(resolved) is None:
          pages[resolved] = _parse(resolved).ids
        if urllib.parse.unquote(fragment) not in pages[resolved]:
          broken.append(f"{os.path.relpath(path, site)}: {link} (no id #{fragment})")
  assert not broken, f"{len(broken)} broken local links:\n" + "\n".join(sorted(set(broken))[:50])
