"""Lab 03a's checker (minitron.labs.bucketed_dp) on 3 gloo ranks: the reference passes,
and each plausible mistake in bucketed, overlapped gradient averaging fails with its own
line (all in as few launches as the outcomes allow)."""
import pytest

from minitron.labs.bucketed_dp import check_bucketed_dp_all

BUCKETED = '''
class BucketedGradSync:
    def __init__(self, params, comm, bucket_mb):
        self.comm, self.d = comm, comm.size("dp")
        self.params = [p for p in reversed(list(params)) if p.requires_grad]
        cap = bucket_elements(bucket_mb, self.params[0].element_size())
        self.buckets, bucket, size = [], [], 0
        for p in self.params:
            bucket.append(p)
            size += p.numel()
            if size >= cap:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {p: k for k, b in enumerate(self.buckets) for p in b}
        self.last = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)
        self.zero_grad()

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.missing, self.next, self.handles = [len(b) for b in self.buckets], 0, []

    @contextmanager
    def microbatch(self, last):
        self.last = last
        try:
            yield
        finally:
            self.last = False

    def grad_ready(self, p):
        if not self.last:
            return
        self.missing[self.bucket_of[p]] -= 1
        self.start_ready()

    def start_ready(self, force=False):
        while self.next < len(self.buckets) and (force or self.missing[self.next] == 0):
            bucket = self.buckets[self.next]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]) / self.d
            self.handles.append((bucket, flat, self.comm.all_reduce(flat, "dp", async_op=True)))
            self.next += 1

    def finish(self):
        self.start_ready(force=True)
        for bucket, flat, handle in self.handles:
            handle.wait()
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.next, self.handles = 0, []
'''

MISTAKES = {  # name: (source, words the one-line message must contain)
    "sum instead of mean": (BUCKETED.replace(") / self.d\n", ")\n"), "times the mean"),
    "buckets in forward order": (BUCKETED.replace("reversed(list(params))", "list(params)"),
                                 "reverse parameter order"),
    "all-reduce in finish only": (BUCKETED.replace("        self.missing[self.bucket_of[p]] -= 1\n        "
                                                   "self.start_ready()\n", "        pass\n"), "only in finish()"),
    "waiting in the hook": (BUCKETED.replace('async_op=True)))\n', 'async_op=True)))\n'
                                             '            self.handles[-1][2].wait()\n'), "your hook waits"),
    "blocking all-reduce in the hook": (BUCKETED.replace(
        'self.handles.append((bucket, flat, self.comm.all_reduce(flat, "dp", async_op=True)))',
        'self.comm.all_reduce(flat, "dp")\n            self.handles.append((bucket, flat, None))').replace(
        "            handle.wait()\n", ""), "blocking all-reduce"),
    "a bucket never flushed": (BUCKETED.replace("        if bucket:\n            self.buckets.append(bucket)\n", "")
                               .replace("        if not self.last:\n", "        if not self.last or p not in "
                                        "self.bucket_of:\n"), "never sent"),
    # what the old checker (2 ranks, the first step only) let through or misnamed
    "bucket size hard-wired to the notebook's": (BUCKETED.replace(
        "cap = bucket_elements(bucket_mb, self.params[0].element_size())", "cap = 2621"),
        "at a size the notebook does not show"),
    "mean hard-wired to 2 ranks": (BUCKETED.replace(") / self.d\n", ") / 2\n"),
                                   "1.5× the mean over the d = 3 ranks"),
    "counters not reset": (BUCKETED.replace("        self.missing, self.next, self.handles = [len(b) for b in "
                                            "self.buckets], 0, []\n",
                                            "        self.missing = getattr(self, 'missing', None) or [len(b) for b "
                                            "in self.buckets]\n        self.next, self.handles = 0, []\n"),
                           "in step 2 (step 1 was right): the all-reduces start only in finish()"),
    "double 1/d": (BUCKETED.replace("p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))",
                                    "p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / self.d)"),
                   "divided by d = 3 once more (1/d²)"),
    # the engine's own buckets, reached past the screen
    **{f"engine by {how}": (f"import importlib, sys\nBucketedGradSync = {data}.BucketedDataParallel\n",
                            "your code runs the engine's own minitron.parallel.data.BucketedDataParallel")
       for how, data in (("importlib", "importlib.import_module('minitron.parallel.' + 'data')"),
                         ("sys.modules", "sys.modules['minitron.parallel' + '.data']"),
                         ("__import__", "__import__('minitron.parallel.' + 'data', fromlist=['x'])"))},
}


@pytest.mark.multirank
def test_reference_passes_and_each_mistake_gets_its_own_line():
    names = list(MISTAKES)
    verdicts = check_bucketed_dp_all([BUCKETED] + [MISTAKES[n][0] for n in names])
    assert verdicts[0]["ok"], verdicts[0]["message"]
    assert verdicts[0]["bytes"] > 0 and verdicts[0]["overlapped"]
    for name, res in zip(names, verdicts[1:]):
        words = MISTAKES[name][1]
        assert not res["ok"], name
        assert "\n" not in res["message"] and words in res["message"], (name, res["message"])
        assert not any(w in res["message"] for n, (_, w) in MISTAKES.items()
                       if n != name and w not in words), (name, res["message"])
