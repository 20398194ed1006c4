//! The manifest (`manifest.json`): what a checkpoint holds, written by
//! [`publish`](super::publish), parsed by [`read_manifest`] and checked
//! against the units a trainer registered ([`check_units`]).

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use zero_core::optim::LossScaler;
use zero_core::partition::{PartitionPlan, TensorSpec, UnitLayout, UnitSpec};
use zero_core::DType;

use super::super::safetensors::ExportDtype;
use super::super::{ck, io};
use super::names::{checkpoint_dir, rank_file};
use super::{BLOCK, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, FROZEN_FILE, MANIFEST_FILE, MODEL_FILE};
use crate::Result;

/// A tensor of a saved unit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TensorEntry {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    /// A frozen tensor (no master or moments in the rank files); absent:
    /// trainable.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) frozen: bool,
}

/// A saved unit: its tensors in packing order, its real elements and its
/// shard length in the saving world.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct UnitEntry {
    pub(crate) name: String,
    pub(crate) tensors: Vec<TensorEntry>,
    pub(crate) numel: usize,
    pub(crate) shard_len: usize,
}

impl UnitEntry {
    fn of(l: &UnitLayout) -> Self {
        Self {
            name: l.name.clone(),
            tensors: l
                .tensors
                .iter()
                .map(|t| TensorEntry {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    frozen: !t.trainable,
                })
                .collect(),
            numel: l.numel,
            shard_len: l.shard_len,
        }
    }
}

/// A rank file: its name, length and the CRC32 of each block.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FileEntry {
    pub(crate) name: String,
    pub(crate) bytes: u64,
    pub(crate) block_size: u64,
    pub(crate) crc32: Vec<u32>,
}

impl FileEntry {
    /// The entry of rank `rank`'s file, `bytes` long, with the CRC32 of
    /// each [`BLOCK`].
    pub(crate) fn rank(rank: usize, bytes: u64, crc32: Vec<u32>) -> Self {
        Self {
            name: rank_file(rank),
            bytes,
            block_size: BLOCK as u64,
            crc32,
        }
    }
}

/// The consolidated 16-bit weights written into the checkpoint directory
/// when `stage3_gather_16bit_weights_on_model_save` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ModelFileEntry {
    pub(crate) name: String,
    /// The safetensors dtype: `BF16`, `F16` or `F32` (the parameter dtype).
    pub(crate) dtype: String,
    pub(crate) bytes: u64,
    /// CRC32 of the whole file.
    pub(crate) crc32: u32,
}

impl ModelFileEntry {
    /// [`MODEL_FILE`] in `dtype`: `bytes` long, with the CRC32 `crc32` of
    /// the whole file.
    pub(crate) fn new(dtype: ExportDtype, bytes: u64, crc32: u32) -> Self {
        Self {
            name: MODEL_FILE.into(),
            dtype: dtype.safetensors_name().into(),
            bytes,
            crc32,
        }
    }

    /// [`FROZEN_FILE`]: the frozen tensors in `dtype`.
    pub(crate) fn frozen(dtype: ExportDtype, bytes: u64, crc32: u32) -> Self {
        Self {
            name: FROZEN_FILE.into(),
            ..Self::new(dtype, bytes, crc32)
        }
    }
}

/// `manifest.json`. Field order is the file's key order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) format: String,
    pub(crate) version: u32,
    pub(crate) world_size: usize,
    pub(crate) stage: u8,
    pub(crate) param_dtype: String,
    pub(crate) steps: u64,
    pub(crate) global_steps: u64,
    pub(crate) loss_scaler: Option<LossScaler>,
    pub(crate) seed: u64,
    pub(crate) config: Value,
    pub(crate) units: Vec<UnitEntry>,
    pub(crate) files: Vec<FileEntry>,
    pub(crate) client_state: Value,
    /// Absent unless `stage3_gather_16bit_weights_on_model_save` (manifests
    /// without it stay version 1 and load as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<ModelFileEntry>,
    /// The frozen tensors' file, when the engine saves them
    /// (`EngineBuilder::checkpoint_frozen`); absent: the frozen tensors
    /// come from the registration on load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) frozen: Option<ModelFileEntry>,
}

/// What a manifest records of the run that saved it (every field but the
/// format's own: format, version, units, files, model).
#[derive(Debug, Clone)]
pub(crate) struct SavedRun {
    /// Ranks of the saving world: one rank file each.
    pub(crate) world_size: usize,
    /// The ZeRO stage.
    pub(crate) stage: u8,
    /// The parameters' (training) dtype.
    pub(crate) param_dtype: DType,
    /// Optimizer steps applied.
    pub(crate) steps: u64,
    /// Optimizer-step boundaries, skipped fp16 steps included.
    pub(crate) global_steps: u64,
    /// The fp16 loss scaler's state.
    pub(crate) loss_scaler: Option<LossScaler>,
    /// The seed of the initialisers.
    pub(crate) seed: u64,
    /// The resolved configuration, as JSON.
    pub(crate) config: Value,
    /// The trainer's own state.
    pub(crate) client_state: Value,
}

impl Manifest {
    /// The manifest of a checkpoint of `run` whose units are `units` (the
    /// saving plan's), with the rank files `files` and the optional
    /// consolidated weights `model`.
    pub(crate) fn new(
        run: SavedRun,
        units: &[UnitLayout],
        files: Vec<FileEntry>,
        model: Option<ModelFileEntry>,
    ) -> Self {
        Self {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            world_size: run.world_size,
            stage: run.stage,
            param_dtype: run.param_dtype.to_string(),
            steps: run.steps,
            global_steps: run.global_steps,
            loss_scaler: run.loss_scaler,
            seed: run.seed,
            config: run.config,
            units: units.iter().map(UnitEntry::of).collect(),
            files,
            client_state: run.client_state,
            model,
            frozen: None,
        }
    }
}

/// The checkpoint directory `path` names (itself, or `latest` under it,
/// see [`checkpoint_dir`]) and its manifest.
pub(crate) fn read_manifest(path: &Path) -> Result<(PathBuf, Manifest)> {
    let dir = checkpoint_dir(path)?;
    let manifest = parse(&dir.join(MANIFEST_FILE))?;
    Ok((dir, manifest))
}

/// Parses the manifest at `mpath`: its format and version first, then
/// every field (an error names the first missing or malformed key that
/// serde names).
fn parse(mpath: &Path) -> Result<Manifest> {
    let text = fs::read_to_string(mpath).map_err(io(mpath, "read"))?;
    let value: Value =
        serde_json::from_str(&text).map_err(|e| ck(mpath, format!("not JSON: {e}")))?;
    match value.get("format").and_then(Value::as_str) {
        Some(CHECKPOINT_FORMAT) => {}
        other => {
            return Err(ck(
                mpath,
                format!("not a zero checkpoint manifest (format {other:?}, expected \"{CHECKPOINT_FORMAT}\")"),
            ))
        }
    }
    match value.get("version").and_then(Value::as_u64) {
        Some(v) if v == u64::from(CHECKPOINT_VERSION) => {}
        other => {
            return Err(ck(
                mpath,
                format!(
                    "unknown manifest version {} (this build reads version {CHECKPOINT_VERSION})",
                    other.map_or("(none)".to_string(), |v| v.to_string())
                ),
            ))
        }
    }
    serde_json::from_value(value).map_err(|e| ck(mpath, format!("malformed manifest: {e}")))
}

/// The saved units (manifest `mpath`) must be the `registered` ones;
/// returns the saving plan.
pub(crate) fn check_units(
    mpath: &Path,
    m: &Manifest,
    registered: &[&UnitSpec],
) -> Result<PartitionPlan> {
    let n = m.units.len().max(registered.len());
    for i in 0..n {
        match (m.units.get(i), registered.get(i)) {
            (Some(s), None) => {
                return Err(ck(
                    mpath,
                    format!(
                        "unit `{}` (#{i}) is in the checkpoint but was not registered",
                        s.name
                    ),
                ))
            }
            (None, Some(r)) => {
                return Err(ck(
                    mpath,
                    format!(
                        "unit `{}` (#{i}) was registered but is not in the checkpoint",
                        r.name
                    ),
                ))
            }
            (Some(s), Some(r)) => {
                if s.name != r.name {
                    return Err(ck(
                        mpath,
                        format!(
                            "unit #{i} is `{}` in the checkpoint but `{}` in the model",
                            s.name, r.name
                        ),
                    ));
                }
                let saved: Vec<(&str, &[usize])> = s
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), &t.shape[..]))
                    .collect();
                // A tensor frozen on one side and trainable on the other.
                let state = |frozen: bool| if frozen { "frozen" } else { "trainable" };
                for t in &r.tensors {
                    if let Some(x) = s.tensors.iter().find(|x| x.name == t.name) {
                        if x.frozen == t.trainable {
                            return Err(ck(
                                mpath,
                                format!(
                                    "unit `{}`: tensor `{}` is {} in the model but {} in the \
                                     checkpoint",
                                    s.name,
                                    t.name,
                                    state(!t.trainable),
                                    state(x.frozen)
                                ),
                            ));
                        }
                    }
                }
                // The model's tensors in packing order: trainable first.
                let packed: Vec<&TensorSpec> = r
                    .tensors
                    .iter()
                    .filter(|t| t.trainable)
                    .chain(r.tensors.iter().filter(|t| !t.trainable))
                    .collect();
                let model: Vec<(&str, &[usize])> = packed
                    .iter()
                    .map(|t| (t.name.as_str(), &t.shape[..]))
                    .collect();
                if saved != model {
                    let fmt = |v: &[(&str, &[usize])]| {
                        v.iter()
                            .map(|(n, s)| format!("{n} {s:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    return Err(ck(
                        mpath,
                        format!(
                            "unit `{}`: the checkpoint has tensors [{}], the model [{}]",
                            s.name,
                            fmt(&saved),
                            fmt(&model)
                        ),
                    ));
                }
                let trainable: usize = r
                    .tensors
                    .iter()
                    .filter(|t| t.trainable)
                    .map(TensorSpec::numel)
                    .sum();
                if s.numel != trainable {
                    return Err(ck(
                        mpath,
                        format!(
                            "unit `{}`: {} trainable elements in the checkpoint, {} in the model",
                            s.name, s.numel, trainable
                        ),
                    ));
                }
            }
            (None, None) => unreachable!(),
        }
    }
    saved_plan(mpath, m)
}

/// The plan the checkpoint was saved with, rebuilt from its manifest
/// (`mpath`) alone.
pub(crate) fn saved_plan(mpath: &Path, m: &Manifest) -> Result<PartitionPlan> {
    let specs: Vec<UnitSpec> = m
        .units
        .iter()
        .map(|u| {
            UnitSpec::new(
                u.name.clone(),
                u.tensors
                    .iter()
                    .map(|t| {
                        if t.frozen {
                            TensorSpec::frozen(t.name.clone(), &t.shape)
                        } else {
                            TensorSpec::new(t.name.clone(), &t.shape)
                        }
                    })
                    .collect(),
            )
        })
        .collect();
    if m.world_size == 0 {
        return Err(ck(mpath, "world_size is 0"));
    }
    let plan = PartitionPlan::new(&specs, m.world_size)?;
    for (l, u) in plan.units().iter().zip(&m.units) {
        if l.shard_len != u.shard_len {
            return Err(ck(
                mpath,
                format!(
                    "unit `{}`: shard_len {} in the manifest, but {} ranks give {} (a manifest \
                     from another partitioning rule)",
                    u.name, u.shard_len, m.world_size, l.shard_len
                ),
            ));
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::super::super::TestDir;
    use super::*;

    fn specs() -> Vec<UnitSpec> {
        vec![
            UnitSpec::new("emb", vec![TensorSpec::new("emb.weight", &[10, 4])]),
            UnitSpec::new(
                "head",
                vec![
                    TensorSpec::new("head.weight", &[3, 4]),
                    TensorSpec::new("head.bias", &[3]),
                ],
            ),
        ]
    }

    fn manifest(world: usize) -> Manifest {
        let plan = PartitionPlan::new(&specs(), world).unwrap();
        let run = SavedRun {
            world_size: world,
            stage: 2,
            param_dtype: DType::BF16,
            steps: 7,
            global_steps: 8,
            loss_scaler: None,
            seed: 5,
            config: serde_json::json!({ "train_batch_size": 8 }),
            client_state: serde_json::json!({ "data_position": 8 }),
        };
        let files = (0..world)
            .map(|r| FileEntry::rank(r, 16, vec![1]))
            .collect();
        Manifest::new(run, plan.units(), files, None)
    }

    /// Writes `value` as the manifest of the checkpoint directory `dir`.
    fn write(dir: &Path, value: &Value) -> PathBuf {
        let mpath = dir.join(MANIFEST_FILE);
        fs::write(&mpath, serde_json::to_string_pretty(value).unwrap()).unwrap();
        mpath
    }

    fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
        r.expect_err("an error").to_string()
    }

    /// The manifest's keys in the order of the format, and its values
    /// back unchanged; `model` only when present.
    #[test]
    fn round_trip_and_key_order() {
        let d = TestDir::new("manifest-round-trip");
        let m = manifest(2);
        let text = serde_json::to_string_pretty(&m).unwrap();
        let keys: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("  \"") && !l.starts_with("   "))
            .map(|l| l.trim_start().split('"').nth(1).unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "format",
                "version",
                "world_size",
                "stage",
                "param_dtype",
                "steps",
                "global_steps",
                "loss_scaler",
                "seed",
                "config",
                "units",
                "files",
                "client_state"
            ]
        );
        write(&d.0, &serde_json::to_value(&m).unwrap());
        let (dir, back) = read_manifest(&d.0).unwrap();
        assert_eq!(dir, d.0);
        assert_eq!(
            serde_json::to_string(&back).unwrap(),
            serde_json::to_string(&m).unwrap()
        );
        assert_eq!(back.param_dtype, "bf16");
        assert_eq!(back.files[1].name, "rank00001.bin");
        assert_eq!(back.files[1].block_size, BLOCK as u64);
        let with_model = Manifest {
            model: Some(ModelFileEntry::new(ExportDtype::Bf16, 100, 7)),
            ..m
        };
        let v = serde_json::to_value(&with_model).unwrap();
        assert_eq!(
            v["model"],
            serde_json::json!({ "name": "model.safetensors", "dtype": "BF16", "bytes": 100, "crc32": 7 })
        );
    }

    /// Parse errors name the manifest and the key: a missing or malformed
    /// field, the format, the version; text that is not JSON.
    #[test]
    fn parse_errors_name_the_key() {
        let d = TestDir::new("manifest-errors");
        let good = serde_json::to_value(manifest(2)).unwrap();
        let mpath = d.0.join(MANIFEST_FILE);
        let shown = mpath.display().to_string();
        let mut cases: Vec<(Value, &str)> = Vec::new();
        for key in ["steps", "units", "client_state", "world_size"] {
            let mut v = good.clone();
            v.as_object_mut().unwrap().remove(key);
            cases.push((v, key));
        }
        let mut v = good.clone();
        v["format"] = "deepspeed".into();
        cases.push((
            v,
            r#"not a zero checkpoint manifest (format Some("deepspeed")"#,
        ));
        let mut v = good.clone();
        v["version"] = 2.into();
        cases.push((v, "unknown manifest version 2 (this build reads version 1)"));
        let mut v = good.clone();
        v.as_object_mut().unwrap().remove("version");
        cases.push((v, "unknown manifest version (none)"));
        let mut v = good.clone();
        v["units"][1]["tensors"][0]
            .as_object_mut()
            .unwrap()
            .remove("shape");
        cases.push((v, "missing field `shape`"));
        for (v, want) in cases {
            write(&d.0, &v);
            let e = err_text(read_manifest(&d.0));
            assert!(e.contains(&shown), "{e}");
            assert!(e.contains(want), "`{want}` not in: {e}");
        }
        fs::write(&mpath, "{ not json").unwrap();
        let e = err_text(read_manifest(&d.0));
        assert!(e.contains("not JSON"), "{e}");
    }

    /// The saving plan comes back from the manifest alone; a manifest
    /// whose shard lengths or world size cannot come from this
    /// partitioning is refused, naming the unit or the key.
    #[test]
    fn saved_plan_is_rebuilt_and_checked() {
        let mpath = Path::new("/ck/manifest.json");
        let m = manifest(3);
        let plan = saved_plan(mpath, &m).unwrap();
        assert_eq!(plan.world_size(), 3);
        let want = PartitionPlan::new(&specs(), 3).unwrap();
        assert_eq!(plan.units(), want.units());
        let mut bad = m.clone();
        bad.units[1].shard_len += 1;
        let e = err_text(saved_plan(mpath, &bad));
        assert!(e.contains("unit `head`: shard_len"), "{e}");
        let mut zero = m;
        zero.world_size = 0;
        assert!(err_text(saved_plan(mpath, &zero)).contains("world_size is 0"));
    }

    /// The registered units must be the saved ones; errors name the unit.
    #[test]
    fn registered_units_must_match() {
        let mpath = Path::new("/ck/manifest.json");
        let m = manifest(2);
        let s = specs();
        let all: Vec<&UnitSpec> = s.iter().collect();
        let plan = check_units(mpath, &m, &all).unwrap();
        assert_eq!(plan.units().len(), 2);
        let e = err_text(check_units(mpath, &m, &all[..1]));
        assert!(e.contains("unit `head` (#1) is in the checkpoint but was not registered"));
        let extra = UnitSpec::new("extra", vec![TensorSpec::new("x", &[2])]);
        let more = [all[0], all[1], &extra];
        let e = err_text(check_units(mpath, &m, &more));
        assert!(e.contains("unit `extra` (#2) was registered but is not in the checkpoint"));
        let swapped = [all[1], all[0]];
        let e = err_text(check_units(mpath, &m, &swapped));
        assert!(e.contains("unit #0 is `emb` in the checkpoint but `head` in the model"));
        let reshaped = UnitSpec::new("emb", vec![TensorSpec::new("emb.weight", &[4, 10])]);
        let e = err_text(check_units(mpath, &m, &[&reshaped, all[1]]));
        assert!(
            e.contains("unit `emb`: the checkpoint has tensors [emb.weight [10, 4]], the model [emb.weight [4, 10]]"),
            "{e}"
        );
    }
}
