//! The first host of a Slurm node list (`SLURM_JOB_NODELIST`), where rank 0 runs: Slurm
//! starts task 0 on the first node of the allocation, so that host is the rendezvous address.
//!
//! Slurm's compressed form joins hosts with commas and folds numbered hosts into brackets:
//! `gpu[01-04,07],cpu3` is gpu01 … gpu04, gpu07 and cpu3. Only the first host is needed, so
//! this expands nothing: it takes the first comma-separated entry (commas inside brackets do
//! not separate hosts) and, for a bracket, its first number or range start, keeping its zero
//! padding. A name may hold several brackets (`rack[1-2]-gpu[01-08]` → `rack1-gpu01`).

use super::LaunchError;

/// The first host of `nodelist` (`gpu[01-04,07],cpu3` → `gpu01`).
pub fn first_host(nodelist: &str) -> Result<String, LaunchError> {
    let invalid = |why: &str| {
        LaunchError::Env(format!(
            "SLURM_JOB_NODELIST={nodelist:?} is not a Slurm node list ({why}); \
             set MASTER_ADDR to rank 0's host instead"
        ))
    };
    let list = nodelist.trim();
    let mut host = String::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                // The bracket's first element: up to the first ',' '-' or ']'.
                let mut first = String::new();
                let mut closed = false;
                for inner in chars.by_ref() {
                    match inner {
                        ']' => {
                            closed = true;
                            break;
                        }
                        ',' | '-' if first.is_empty() => return Err(invalid("an empty range")),
                        ',' | '-' => {
                            // Skip the rest of the bracket.
                            for rest in chars.by_ref() {
                                if rest == ']' {
                                    closed = true;
                                    break;
                                }
                            }
                            break;
                        }
                        d if d.is_ascii_digit() => first.push(d),
                        _ => return Err(invalid("a bracket holds a non-digit")),
                    }
                }
                if !closed {
                    return Err(invalid("an unclosed '['"));
                }
                if first.is_empty() {
                    return Err(invalid("an empty bracket"));
                }
                host.push_str(&first);
            }
            ']' => return Err(invalid("a ']' without '['")),
            c if c.is_whitespace() => return Err(invalid("a space inside a host name")),
            c => host.push(c),
        }
    }
    if host.is_empty() {
        return Err(invalid("no host"));
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slurm's own examples and the forms a cluster shows: a plain host, a list, brackets with
    /// ranges and zero padding, commas inside brackets, several brackets in one name.
    #[test]
    fn the_first_host_of_each_form() {
        let cases = [
            ("gpu[01-04,07],cpu3", "gpu01"),
            ("node7", "node7"),
            ("node7,node8", "node7"),
            ("gpu[007-012]", "gpu007"),
            ("gpu[3,5-6]", "gpu3"),
            ("gpu[10]", "gpu10"),
            ("rack[1-2]-gpu[01-08]", "rack1-gpu01"),
            ("a-b.example.org", "a-b.example.org"),
            (" gpu[2-3] ", "gpu2"),
        ];
        for (list, first) in cases {
            assert_eq!(first_host(list).unwrap(), first, "{list}");
        }
    }

    /// A broken list is an error that names the variable and the way out (MASTER_ADDR), never a
    /// guessed host.
    #[test]
    fn a_malformed_list_names_the_variable_and_the_fix() {
        for list in [
            "",
            "gpu[01-04",
            "gpu[]",
            "gpu[a-b]",
            "gpu]",
            "gpu[-3]",
            ",node1",
        ] {
            let err = first_host(list).unwrap_err().to_string();
            assert!(err.contains("SLURM_JOB_NODELIST"), "{list}: {err}");
            assert!(err.contains("MASTER_ADDR"), "{list}: {err}");
        }
    }
}
