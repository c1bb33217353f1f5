use super::*;

#[test]
fn stale_reports_are_dropped_and_a_lost_generation_ends() {
    let mut pg = PlaygroundState::default();
    pg.sides[0].seq = 2;
    pg.sides[0].loading = Some(2);
    let stale = PgMsg::Loaded {
        side: 0,
        seq: 1,
        result: Err(JobError::other("old")),
    };
    assert!(on_message(&mut pg, stale).is_empty());
    assert_eq!(pg.sides[0].loading, Some(2));
    let fresh = PgMsg::Loaded {
        side: 0,
        seq: 2,
        result: Err(JobError::of(ErrorKind::Model, "broken")),
    };
    on_message(&mut pg, fresh);
    assert!(pg.sides[0].loading.is_none());
    assert_eq!(
        pg.sides[0].load_error.as_ref().map(|e| e.kind),
        Some(ErrorKind::Model)
    );

    // A picked prompt file is read by a job, not here.
    let follow = on_message(&mut pg, PgMsg::Picked(PgPick::Prompts, "p.txt".into()));
    assert!(matches!(follow.as_slice(), [PgAction::ReadPrompts(p)] if p == Path::new("p.txt")));
    assert!(pg.prompts_loading);
    on_message(
        &mut pg,
        PgMsg::Prompts(Ok((vec!["a".into()], "1 prompt".into()))),
    );
    assert!(!pg.prompts_loading);
    assert_eq!(pg.batch_prompts, vec!["a".to_string()]);

    // Events of an older generation are ignored; an end without `Done` is an error.
    pg.sides[1].handle = None;
    on_message(&mut pg, PgMsg::GenEnded { side: 1, seq: 7 });
    assert!(pg.sides[1].output.error.is_none());
}
