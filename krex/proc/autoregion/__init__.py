from krex.proc.autoregion.hook import *  # noqa: F403  (temporary, split next)
from krex.proc.autoregion.hook import BUILTINS, MARK, UsageError, _Finder  # noqa: F401
from krex.proc.envvars import hook_dir  # noqa: F401
