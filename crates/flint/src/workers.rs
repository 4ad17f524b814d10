//! `flint serve --worker SPEC`: the device workers of one server, each a whole engine (its own
//! scheduler, KV pool, prefix cache and, on the CPU, its own kernel threads pinned to cores no
//! other worker uses), built over weights loaded once per distinct (model, dtype).

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use flint_engine::loader::available_memory;
use flint_engine::{
    build_core, load_draft, plan, same_vocabulary, Engine, EngineConfig, EngineThread, LoadedModel, PoolPlan,
};
use flint_model::device::DeviceSpec;
use flint_model::kernels::pool::{core_cpus, KernelPool};

use crate::engine_args::{parse_bytes, parse_dtype};

/// One `--worker` value: `device=cpu,threads=1,kv-cache-memory=2G,max-num-seqs=16,dtype=bf16,model=PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub device: DeviceSpec,
    /// CPU threads (kernel threads plus the engine's own); default: the cores left, shared evenly.
    pub threads: Option<usize>,
    pub kv_cache_memory: Option<usize>,
    pub max_num_seqs: Option<usize>,
    /// Compute dtype of dense weights (as `--dtype`); default: the server's.
    pub dtype: Option<String>,
    /// Other weights of the same model (another quantization: same vocabulary and tokenizer);
    /// default: `--model`.
    pub model: Option<String>,
}

impl std::str::FromStr for WorkerSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut spec = WorkerSpec {
            device: DeviceSpec::Cpu,
            threads: None,
            kv_cache_memory: None,
            max_num_seqs: None,
            dtype: None,
            model: None,
        };
        let bad = |m: String| Err(format!("--worker {s:?}: {m}"));
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return bad(format!(
                    "{part:?} is not key=value (keys: device, threads, kv-cache-memory, max-num-seqs, dtype, model)"
                ));
            };
            let (k, v) = (k.trim().replace('_', "-"), v.trim());
            let count = |v: &str| match v.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(format!("--worker {s:?}: {k} must be a whole number of at least 1, got {v:?}")),
            };
            match k.as_str() {
                "device" => spec.device = v.parse().map_err(|m: String| format!("--worker {s:?}: {m}"))?,
                "threads" => spec.threads = Some(count(v)?),
                "max-num-seqs" => spec.max_num_seqs = Some(count(v)?),
                "kv-cache-memory" => {
                    spec.kv_cache_memory =
                        Some(parse_bytes(v).map_err(|e| format!("--worker {s:?}: kv-cache-memory: {e}"))?)
                }
                "dtype" => match v {
                    "auto" | "f32" | "bf16" | "f16" => spec.dtype = Some(v.to_string()),
                    _ => return bad(format!("dtype must be auto, f32, bf16 or f16, got {v:?}")),
                },
                "model" => spec.model = Some(v.to_string()),
                _ => {
                    return bad(format!(
                        "unknown key {k:?} (keys: device, threads, kv-cache-memory, max-num-seqs, dtype, model)"
                    ))
                }
            }
        }
        if spec.device != DeviceSpec::Cpu && spec.threads.is_some() {
            return bad("threads= applies to CPU workers only".into());
        }
        Ok(spec)
    }
}

impl WorkerSpec {
    /// The worker's name in logs, metrics and `/health`: its device and its index among workers.
    fn name(&self, i: usize) -> String {
        match self.device {
            DeviceSpec::Cpu => format!("cpu{i}"),
            DeviceSpec::Cuda(d) => format!("cuda{d}-{i}"),
            DeviceSpec::Metal => format!("metal{i}"),
        }
    }
}

/// A started worker, with what the banner says about it.
pub struct BuiltWorker {
    pub name: String,
    pub engine: Engine,
    pub pool: PoolPlan,
    pub describe: String,
}

/// Threads per CPU worker and the cores each is pinned to: explicit `threads=` first, the cores
/// left shared evenly among the others. `cores` is the process's CPUs grouped by physical core
/// (`None`: unknown topology, no pinning).
pub fn assign_cores(specs: &[WorkerSpec], cores: Option<&[Vec<usize>]>) -> Result<Vec<(usize, Option<Vec<usize>>)>> {
    let cpu: Vec<usize> = (0..specs.len()).filter(|&i| specs[i].device == DeviceSpec::Cpu).collect();
    let available = cores.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), |c| c.len());
    let fixed: usize = cpu.iter().filter_map(|&i| specs[i].threads).sum();
    let flexible = cpu.iter().filter(|&&i| specs[i].threads.is_none()).count();
    if fixed + flexible > available {
        bail!(
            "--worker: the CPU workers need {} thread(s) (threads= {fixed}, at least 1 for each of the {flexible} without) \
             but this process may run on {available} physical core(s); each CPU worker gets cores of its own",
            fixed + flexible
        );
    }
    let share = (available - fixed).checked_div(flexible).unwrap_or(0);
    let mut extra = (available - fixed).checked_rem(flexible).unwrap_or(0);
    let mut next = 0;
    let mut out = vec![(0, None); specs.len()];
    for &i in &cpu {
        let n = specs[i].threads.unwrap_or_else(|| {
            let e = usize::from(extra > 0);
            extra = extra.saturating_sub(1);
            share + e
        });
        let cpus = cores.map(|c| c[next..next + n].iter().flatten().copied().collect());
        next += n;
        out[i] = (n, cpus);
    }
    Ok(out)
}

/// Load the weights each worker serves (once per distinct model and dtype), plan each worker's
/// pool and start its engine.
pub fn build(
    specs: &[WorkerSpec],
    default_model: Option<&str>,
    default_dtype: Option<DType>,
    base: &EngineConfig,
) -> Result<(LoadedModel, Vec<BuiltWorker>)> {
    // Every device opens (or says why not) before any weights load.
    let mut devices: HashMap<DeviceSpec, Device> = HashMap::new();
    for (i, s) in specs.iter().enumerate() {
        if let std::collections::hash_map::Entry::Vacant(e) = devices.entry(s.device) {
            e.insert(s.device.open().with_context(|| format!("--worker {i}"))?);
        }
    }
    let cores = core_cpus();
    if cores.is_none() {
        tracing::warn!("cannot read the CPU topology: CPU workers run unpinned");
    }
    let threads = assign_cores(specs, cores.as_deref())?;
    // Weights loaded once per (model, dtype, device): CPU workers on the same checkpoint share them.
    type Key = (Option<String>, Option<String>, DeviceSpec);
    let mut loaded: HashMap<Key, LoadedModel> = HashMap::new();
    let key = |s: &WorkerSpec| (s.model.clone().or(default_model.map(String::from)), s.dtype.clone(), s.device);
    for s in specs {
        let k = key(s);
        if loaded.contains_key(&k) {
            continue;
        }
        let dtype = s.dtype.as_deref().map_or(default_dtype, parse_dtype);
        let lm = LoadedModel::load(k.0.as_deref(), &devices[&s.device], dtype)
            .with_context(|| format!("loading {}", k.0.as_deref().unwrap_or("the demo model")))?;
        loaded.insert(k, lm);
    }
    let first = loaded.get(&key(&specs[0])).ok_or_else(|| anyhow!("no worker"))?;
    for s in &specs[1..] {
        let other = &loaded[&key(s)];
        same_vocabulary(first, other).map_err(|m| {
            anyhow!("--worker model={}: {m}", s.model.as_deref().unwrap_or(default_model.unwrap_or("demo")))
        })?;
    }
    let avail = available_memory().unwrap_or(4 << 30);
    let mut workers = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let lm = &loaded[&key(s)];
        let mut ec = base.clone();
        if let Some(m) = s.max_num_seqs {
            ec.max_num_seqs = m;
        }
        ec.kv_cache_memory = s.kv_cache_memory.or(base.kv_cache_memory);
        let draft = load_draft(lm, &ec)?;
        let mut pool = plan(lm, draft.as_ref(), &ec)?;
        if ec.kv_cache_memory.is_none() && specs.len() > 1 {
            // The default budget (a quarter of free memory) is shared by the workers.
            let share = (avail / 4 / specs.len()).min(pool.pool_bytes);
            ec.kv_cache_memory = Some(share);
            pool = plan(lm, draft.as_ref(), &ec)?;
        }
        let core = build_core(lm, draft.as_ref(), &pool)?;
        let name = s.name(i);
        // A GPU worker's engine thread only launches kernels: it needs no kernel threads.
        let (kernels, where_) = if s.device == DeviceSpec::Cpu {
            let (n, cpus) = threads[i].clone();
            let kernels = KernelPool::start(n, cpus);
            let where_ = match kernels.cpus() {
                Some(c) => format!("cpu, {} thread(s) pinned to CPUs {c:?}", kernels.threads()),
                None => format!("cpu, {} thread(s), unpinned", kernels.threads()),
            };
            (Some(kernels), where_)
        } else {
            (None, s.device.to_string())
        };
        let describe = format!(
            "worker {name}: {where_}, {:?} compute of {} | {} | max-num-seqs {}",
            lm.model.dtype(),
            lm.source,
            pool.describe(),
            pool.sched.max_num_seqs
        );
        let engine = Engine::start_with(core, EngineThread { name: Some(name.clone()), kernels });
        workers.push(BuiltWorker { name, engine, pool, describe });
    }
    let k = key(&specs[0]);
    let first = loaded.remove(&k).ok_or_else(|| anyhow!("no worker"))?;
    Ok((first, workers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> WorkerSpec {
        s.parse().unwrap()
    }

    #[test]
    fn specs_parse_with_vllm_style_keys() {
        let s = spec("device=cpu,threads=2,kv-cache-memory=1G,max_num_seqs=8,dtype=bf16,model=/m/q4.gguf");
        assert_eq!(s.device, DeviceSpec::Cpu);
        assert_eq!((s.threads, s.kv_cache_memory, s.max_num_seqs), (Some(2), Some(1 << 30), Some(8)));
        assert_eq!((s.dtype.as_deref(), s.model.as_deref()), (Some("bf16"), Some("/m/q4.gguf")));
        assert_eq!(spec("device=cuda:1").device, DeviceSpec::Cuda(1));
        assert_eq!(spec("device=metal").device, DeviceSpec::Metal);
        assert_eq!(spec("").device, DeviceSpec::Cpu);
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let err = |s: &str| s.parse::<WorkerSpec>().unwrap_err();
        assert!(err("device=tpu").contains("unknown device \"tpu\""));
        assert!(err("threads=0").contains("threads must be a whole number of at least 1"));
        assert!(err("cores=2").contains("unknown key \"cores\""));
        assert!(err("cpu").contains("not key=value"));
        assert!(err("dtype=q4").contains("dtype must be"));
        assert!(err("device=cuda:0,threads=2").contains("CPU workers only"));
        assert!(err("kv-cache-memory=lots").contains("kv-cache-memory"));
    }

    #[test]
    fn cores_are_disjoint_and_shared_evenly() {
        let cores: Vec<Vec<usize>> = vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]];
        let specs = [spec("threads=1"), spec(""), spec("")];
        let a = assign_cores(&specs, Some(&cores)).unwrap();
        assert_eq!(a[0], (1, Some(vec![0, 4])));
        assert_eq!(a[1], (2, Some(vec![1, 5, 2, 6])));
        assert_eq!(a[2], (1, Some(vec![3, 7])));
        let err = assign_cores(&[spec("threads=3"), spec("threads=2")], Some(&cores)).unwrap_err().to_string();
        assert!(err.contains("need 5 thread(s)") && err.contains("4 physical core(s)"), "{err}");
        // Unknown topology: threads counted against the logical CPUs, nothing pinned.
        let a = assign_cores(&[spec("threads=1")], None).unwrap();
        assert_eq!(a[0], (1, None));
    }

    #[test]
    fn unsupported_devices_fail_before_loading_anything() {
        let err = build(&[spec("device=cuda:0")], Some("/nonexistent"), None, &EngineConfig::default())
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap();
        // Without the cuda feature the device cannot open; with it and no GPU, neither.
        assert!(err.contains("--worker 0") && err.contains("--device cuda:0"), "{err}");
        let err = build(&[spec("device=metal")], Some("/nonexistent"), None, &EngineConfig::default()).err().unwrap();
        assert!(format!("{err:#}").contains("no Metal kernels"), "{err:#}");
    }
}
