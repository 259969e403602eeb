//! TensorBoard scalar event files, written directly: a TFRecord stream of `Event` protobufs.
//! Only scalars are needed, so the few protobuf fields involved are encoded by hand rather than
//! pulling in a protobuf toolchain.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

pub struct EventWriter {
    file: File,
}

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn length_delimited(field: u8, bytes: &[u8], out: &mut Vec<u8>) {
    out.push((field << 3) | 2);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

fn event(wall_time: f64, step: i64, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut e = vec![0x09];
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(0x10);
    varint(step as u64, &mut e);
    body(&mut e);
    e
}

impl EventWriter {
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create TensorBoard folder {}", dir.display()))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "titan".into());
        let path = dir.join(format!("events.out.tfevents.{}.{host}", now.as_secs()));
        let file =
            File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = EventWriter { file };
        w.record(&event(now.as_secs_f64(), 0, |e| {
            length_delimited(3, b"brain.Event:2", e)
        }))?;
        Ok(w)
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut buf = Vec::with_capacity(data.len() + 16);
        buf.extend_from_slice(&len);
        buf.extend_from_slice(&masked_crc(&len).to_le_bytes());
        buf.extend_from_slice(data);
        buf.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&buf)?;
        Ok(())
    }

    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            length_delimited(1, tag.as_bytes(), &mut value);
            value.push(0x15);
            value.extend_from_slice(&(*v as f32).to_le_bytes());
            length_delimited(1, &value, &mut summary);
        }
        self.record(&event(wall, step as i64, |e| {
            length_delimited(5, &summary, e)
        }))?;
        self.file.flush()?;
        Ok(())
    }
}
