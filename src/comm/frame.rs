//! The socket data path's framing: every message between two ranks travels behind a 16-byte header
//! (its index on this link, its length in bytes), so ranks that fall out of step (they called
//! different collectives, or the same with different sizes) get an error naming both sides instead
//! of reading one message's bytes as another's. The direct-read path checks the same with its
//! phase messages (`group.rs::exchange_phase`).

use std::io::{Read, Write};

use super::conn::Conn;

const HEADER: usize = 16;
/// Up to this size a message and its header go out in one write (one packet on the latency path).
const COALESCE: usize = 64 << 10;

/// The sending half of a link.
pub struct FramedWriter {
    conn: Conn,
    sent: u64,
}

/// The receiving half of a link.
pub struct FramedReader {
    conn: Conn,
    received: u64,
}

/// Why a message could not be received.
#[derive(Debug)]
pub enum RecvError {
    Io(std::io::Error),
    /// The peer's next message is not the one this rank expects.
    OutOfStep {
        index: u64,
        len: u64,
        expected_index: u64,
        expected_len: usize,
    },
}

impl FramedWriter {
    pub fn new(conn: Conn) -> Self {
        FramedWriter { conn, sent: 0 }
    }

    /// Sends `bytes` as this link's next message.
    pub fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&self.sent.to_le_bytes());
        header[8..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        if bytes.len() <= COALESCE {
            let mut msg = Vec::with_capacity(HEADER + bytes.len());
            msg.extend_from_slice(&header);
            msg.extend_from_slice(bytes);
            self.conn.write_all(&msg)?;
        } else {
            self.conn.write_all(&header)?;
            self.conn.write_all(bytes)?;
        }
        self.sent += 1;
        Ok(())
    }
}

impl FramedReader {
    pub fn new(conn: Conn) -> Self {
        FramedReader { conn, received: 0 }
    }

    /// The connection (its timeouts, its peer's credentials).
    pub fn conn(&self) -> &Conn {
        &self.conn
    }

    /// Receives this link's next message into `bytes`, which must be exactly its length.
    pub fn recv(&mut self, bytes: &mut [u8]) -> Result<(), RecvError> {
        let mut header = [0u8; HEADER];
        self.conn.read_exact(&mut header).map_err(RecvError::Io)?;
        let word = |k: usize| u64::from_le_bytes(header[k..k + 8].try_into().expect("8 bytes"));
        let (index, len) = (word(0), word(8));
        if index != self.received || len != bytes.len() as u64 {
            return Err(RecvError::OutOfStep {
                index,
                len,
                expected_index: self.received,
                expected_len: bytes.len(),
            });
        }
        self.conn.read_exact(bytes).map_err(RecvError::Io)?;
        self.received += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn messages_arrive_in_order_and_a_wrong_length_is_named() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut w, mut r) = (
            FramedWriter::new(Conn::Unix(a)),
            FramedReader::new(Conn::Unix(b)),
        );
        w.send(&[1, 2, 3]).unwrap();
        w.send(&vec![7u8; 100_000]).unwrap();
        w.send(&[9; 8]).unwrap();
        let mut x = [0u8; 3];
        r.recv(&mut x).unwrap();
        assert_eq!(x, [1, 2, 3]);
        let mut y = vec![0u8; 100_000];
        r.recv(&mut y).unwrap();
        assert!(y.iter().all(|&v| v == 7));
        let mut z = [0u8; 4];
        match r.recv(&mut z) {
            Err(RecvError::OutOfStep {
                index: 2,
                len: 8,
                expected_index: 2,
                expected_len: 4,
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
