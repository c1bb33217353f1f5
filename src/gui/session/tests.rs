use super::*;

#[test]
fn recent_lists_stay_unique_and_short() {
    let mut v = Vec::new();
    for i in 0..15 {
        push_recent(&mut v, i % 12);
    }
    push_recent(&mut v, 3);
    assert_eq!(v[0], 3);
    assert_eq!(v.len(), 10);
    assert_eq!(v.iter().filter(|&&x| x == 3).count(), 1);
}
