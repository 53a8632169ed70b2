"""A serving archive on tract's CUDA runtime against its CPU runtime, on a GPU host with tract and numpy only.

    gdn-export convert fixtures/qwen3_5 -o serving.nnef.tgz --serving --runtime cuda     # here
    python benchmarks/check_serving_cuda.py serving.nnef.tgz                             # there

Two requests of different lengths, prefilled together (B=2, per-row seq_len: the shorter row's last tokens are
padding, identity steps; caches padded to one position), then decoded together for 4 steps (B=2, per-row past_len,
the shorter row's caches padded), as gdn_export.Engine runs them; the logits of every call on the "cuda" runtime
against the same calls on the CPU runtime. Prints the largest
difference, or that this host has no CUDA runtime. A --runtime cpu archive (the chunked lowering) is not for CUDA:
tract 0.23.9's CUDA kernels reject its empty chunk pieces (benchmarks/results/tract_runtimes_h200.md)."""
import json, sys, tarfile
import numpy as np
import tract

path = sys.argv[1]
with tarfile.open(path) as tar:
    meta = json.loads(tar.extractfile("gdn_export.json").read())
specs = meta["states"]
DT = {"float32": np.float32, "float16": np.float16}

def plan(runtime, symbols):
    model = tract.nnef().with_tract_transformers().load(path)
    model.transform(tract.SetSymbols(symbols))
    return model.into_runnable() if runtime == "default" else tract.runtime_for_name(runtime).prepare(model)

def zeros(spec, batch, past):
    return np.zeros([batch if d == "B" else past if d == "P" else d for d in spec["shape"]], DT[spec["dtype"]])

def run(runtime):
    plans = {2: plan(runtime, {"B": 2})}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, meta["vocab_size"], n) for n in (5, 3)]
    seq_len = np.array([len(p) for p in prompts], np.int64)
    ids = np.zeros((2, int(seq_len.max())), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    states = [zeros(s, 2, 1) for s in specs]
    out = [o.to_numpy() for o in plans[2].run([ids, np.zeros(2, np.int64), seq_len, *states])]
    rows = []  # per request: (states list, length)
    for b, n in enumerate(seq_len):
        new = [o[b:b + 1, :, :n] if "P" in s["shape"] else o[b:b + 1] for s, o in zip(specs, out[1:])]
        rows.append([new, int(n)])
    last = out[0][np.arange(2), seq_len - 1] if out[0].shape[1] > 1 else out[0][:, -1]
    logits = [last]
    tokens = [int(np.argmax(l)) for l in last]
    for step in range(4):
        past = np.array([r[1] for r in rows], np.int64)
        padded = int(past.max())
        inputs = []
        for i, s in enumerate(specs):
            if "P" in s["shape"]:
                batch = np.zeros([2, *[padded if d == "P" else d for d in s["shape"][1:]]], DT[s["dtype"]])
                for b, r in enumerate(rows):
                    batch[b, :, :r[1]] = r[0][i][0]
                inputs.append(batch)
            else:
                inputs.append(np.concatenate([r[0][i] for r in rows], axis=0))
        out = [o.to_numpy() for o in plans[2].run([np.array(tokens)[:, None].astype(np.int64), past,
                                                    np.ones(2, np.int64), *inputs])]
        for b, r in enumerate(rows):
            for i, s in enumerate(specs):
                o = out[1 + i][b:b + 1]
                r[0][i] = np.concatenate([r[0][i], o], axis=2) if "P" in s["shape"] else o
            r[1] += 1
        logits.append(out[0][:, -1])
        tokens = [int(np.argmax(l)) for l in out[0][:, -1]]
    return logits

cpu = run("default")
try:
    tract.runtime_for_name("cuda")
except Exception as err:
    print("no cuda runtime:", str(err).splitlines()[0]); sys.exit(0)
gpu = run("cuda")
err = max(float(np.abs(a - b).max()) for a, b in zip(cpu, gpu))
scale = max(float(np.abs(a).max()) for a in cpu)
print(f"{path}: cuda against cpu over a batched prefill (rows of 5 and 3 tokens) + 4 batched decode steps: max |logit diff| {err:.2e} (max |logit| {scale:.2f})")
