//! The operator's commands (an FPGA's exec backend, a `[[clean]]` command): run with no shell
//! and no standard input, in a process group of their own, bounded by a timeout after which the
//! whole group is killed; the exit status is the verdict, and the end of the output is kept for
//! the task's result. Blocking: call it off the async threads.

use std::io::Read;
use std::time::{Duration, Instant};

/// The most output of a command kept with the task's result.
pub const MAX_OUTPUT: usize = 16 << 10;

/// Runs `argv` with no shell and no standard input, within `timeout`; its exit status is the
/// verdict. Returns (or fails with) a summary and its output (at most [`MAX_OUTPUT`] bytes).
pub fn run_command(argv: &[String], timeout: Duration) -> Result<String, String> {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let Some((program, args)) = argv.split_first() else {
        return Err("the command is empty".into());
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let readers = [
        std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = (&mut out).take(MAX_OUTPUT as u64 * 4).read_to_end(&mut b);
            b
        }),
        std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = (&mut err).take(MAX_OUTPUT as u64 * 4).read_to_end(&mut b);
            b
        }),
    ];
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() >= timeout => {
                // The whole process group: a vendor tool's helpers too.
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(child.id() as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for {program}: {e}")),
        }
    };
    let mut output = String::new();
    for r in readers {
        output.push_str(&String::from_utf8_lossy(&r.join().unwrap_or_default()));
    }
    let output = tail(output.trim(), MAX_OUTPUT);
    match status {
        None => Err(format!(
            "{program} did not finish within {}s and was killed; output: {output}",
            timeout.as_secs()
        )),
        Some(s) if s.success() => Ok(format!("{program} succeeded; output: {output}")),
        Some(s) => Err(format!("{program} failed ({s}); output: {output}")),
    }
}

/// The last `max` bytes of `s`, on a character boundary.
fn tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &s[start..])
}
