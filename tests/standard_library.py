"""For the tests that run code as the nodes' system python3 runs it: a snippet that makes a Python process refuse to
import anything outside the standard library and gpucluster, whatever this machine has installed (Debian's python3
here has PyYAML, for one). A module imported at its top from anywhere else then fails."""

ONLY = """
import sys
class StandardLibraryOnly:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in sys.stdlib_module_names | {"gpucluster"}:
            raise ImportError(f"{name} is not in the standard library")
sys.meta_path.insert(0, StandardLibraryOnly())
"""
