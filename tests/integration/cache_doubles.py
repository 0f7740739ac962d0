"""App processes for the compilation-cache tests (run as ``python -c``)."""
import os
import sys
import time

import anyio
import numpy as np

import nnrt
import nnrt.tflite
from nnrt.drivers.reference import ReferenceDevice


class HalfWriter(ReferenceDevice):
    """Writes its cache file, cuts it in half as a crash mid-write would
    leave it, says so in ``ready`` and waits to be killed."""

    def __init__(self, ready: str):
        super().__init__()
        self.ready = ready

    async def prepare_model(self, model, preference=None, priority=None, deadline=None,
                            cache=None, *, app=None):
        prepared = await super().prepare_model(model, cache=cache, app=app)
        fd = cache.model[0]
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        with open(self.ready, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        return prepared


def compile_once(model_path: str, cache_dir: str, go: str | None = None,
                 ready: str | None = None) -> None:
    """Compile ``model_path`` into ``cache_dir`` (after ``go`` exists, when
    given) and print the statistics and the output's checksum."""
    model = nnrt.tflite.load(model_path)
    device = HalfWriter(ready) if ready else ReferenceDevice()

    async def main():
        async with nnrt.Runtime(devices=[device], discover=False, litert=False) as rt:
            while go and not os.path.exists(go):
                await anyio.sleep(0.001)
            compiled = await rt.compile(model, cache_dir=cache_dir)
            hal = model.hal_model
            o = hal.main.operands[hal.main.input_indexes[0]]
            x = np.random.default_rng(7).integers(-128, 127, o.dimensions).astype(o.type.dtype)
            out = (await compiled.execute([x])).outputs[0]
            s = rt.cache_statistics()
            print(s.hits, s.misses, s.rejected, int(np.asarray(out, np.int64).sum()))
    anyio.run(main)


if __name__ == "__main__":
    compile_once(*sys.argv[1:])
