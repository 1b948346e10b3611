"""Imported last by the rank server (`forked._forkserver`): freezes the heap it preloaded.

With torch, megatron and vLLM imported the server holds ~660k objects. Frozen (`gc.freeze()`), every rank forked
from it skips them in its full collections (vLLM's engine build runs three, 0.4 s each here) and leaves their
pages shared with the server (a collection writes to each object it visits: copy-on-write). The preload's garbage
is collected first, so nothing that could be freed is frozen (`hybridrl.parallel.heap.freeze_heap`).
"""
from hybridrl.parallel.heap import freeze_heap

freeze_heap()
