//! Console output that never panics: every line titan prints to stdout or stderr.
//!
//! `println!` and `eprintln!` panic when their stream is closed, and a panic ends only the thread
//! that printed. A worker whose launcher was killed writes into a pipe nobody reads; had it
//! panicked there, the thread that was meant to end the process (the flight recorder's SIGTERM
//! handler) would die instead and the worker would train on, orphaned. A launcher piped into
//! `head` would lose the threads that drain its workers' output, and the workers would block on a
//! full pipe. So titan prints only through `outln!`, `out!` and `errln!`, which drop what
//! nobody is left to read and carry on; `clippy.toml` refuses the std macros in `src/`.
//!
//! Written by hand: a few lines over `std::io`, nothing a crate would add to.

use std::fmt::Arguments;
use std::io::Write;

/// Writes `args` (and a newline when `newline`) to stdout (`to_stderr` false) or stderr in one
/// write, so lines of different threads do not interleave; a closed stream drops the text.
pub fn write(to_stderr: bool, newline: bool, args: Arguments) {
    let mut text = std::fmt::format(args);
    if newline {
        text.push('\n');
    }
    let written = if to_stderr {
        std::io::stderr().lock().write_all(text.as_bytes())
    } else {
        let mut out = std::io::stdout().lock();
        // Text without a newline (a streamed generation) shows at once, as print! + flush would.
        out.write_all(text.as_bytes()).and_then(|_| out.flush())
    };
    // Nobody reads the stream any more: there is no one left to tell.
    drop(written);
}

/// `println!` that never panics (see the module doc).
#[macro_export]
macro_rules! outln {
    () => { $crate::console::write(false, true, format_args!("")) };
    ($($arg:tt)*) => { $crate::console::write(false, true, format_args!($($arg)*)) };
}

/// `print!` that never panics, flushed at once.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::console::write(false, false, format_args!($($arg)*)) };
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => { $crate::console::write(true, true, format_args!("")) };
    ($($arg:tt)*) => { $crate::console::write(true, true, format_args!($($arg)*)) };
}

#[cfg(test)]
mod tests {
    /// A closed stdout (the read end of its pipe gone) is dropped silently, not a panic.
    #[test]
    fn a_closed_stream_is_not_a_panic() {
        let mut fds = [0; 2];
        // SAFETY: pipe(2) into a two-int array; dup/dup2/close on descriptors this test owns.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            libc::close(fds[0]);
            let saved = libc::dup(1);
            libc::dup2(fds[1], 1);
            let printed = std::panic::catch_unwind(|| outln!("into a closed pipe"));
            libc::dup2(saved, 1);
            libc::close(saved);
            libc::close(fds[1]);
            assert!(printed.is_ok(), "outln! panicked on a closed stdout");
        }
    }
}
