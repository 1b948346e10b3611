"""Import a user's Python file (a reward function, a tools file): trusted code, executed as it loads.

One loader for every place a config names a file of the user's code, so each fails the same way:
the caller's error class, with the file and what went wrong. Torch-free, imports nothing of hybridrl.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

# hybridrl modules a user's file may still import under an earlier name -> the name they have now
RENAMED_MODULES = {"hybridrl.tools": "hybridrl.tool_calling"}


def renamed_module_hint(exc: BaseException) -> str:
    """For an import of a module hybridrl has renamed: what to import instead (else "")."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    for old, new in RENAMED_MODULES.items():
        if missing == old or (missing or "").startswith(old + "."):
            return f" ({old} is now {new}: import from {new} instead)"
    return ""


def import_user_file(path: str | Path, *, what: str, prefix: str, error: type[Exception]) -> ModuleType:
    """The module of the file `path` (`what` names it in errors, e.g. "custom reward file"); `error` is raised for a
    missing file, a file that is not a module, or one whose import fails.

    The file imports its neighbours as it would run as a script beside them: it is a module of a package that
    stands for its folder (`prefix` + a hash of the folder), so `from .helper import f` finds the folder's
    helper.py, and the folder is on `sys.path` while it executes (first, as a script's is) and after it (last: a
    later `import helper` in a function still finds it, and nothing the trainer imports later is shadowed by a file
    of the user's folder), so `import helper` does too."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {str(path)!r} does not exist")
    folder = path.resolve().parent
    package_name = f"{prefix}{abs(hash(str(folder)))}"
    if package_name not in sys.modules:
        package = ModuleType(package_name)
        package.__path__ = [str(folder)]  # a namespace package of the folder: relative imports resolve there
        sys.modules[package_name] = package
    module_name = package_name + "." + re.sub(r"\W", "_", path.stem)  # a file name may hold a dash
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before executing so dataclasses/pickling inside the file can find their module.
    sys.modules[module_name] = module
    on_path = str(folder) in sys.path
    if not on_path:
        sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise error(f"importing {what} {str(path)!r} failed: {exc!r}{renamed_module_hint(exc)}") from exc
    finally:
        if not on_path:
            sys.path.remove(str(folder))
            sys.path.append(str(folder))
    return module
