//! The distillation section as a run loads and audits it.
use crate::{AuditContext, Config, ConfigError, EngineRole, PluginSections, Severity, audit};

fn load(args: &[&str]) -> Result<Config, ConfigError> {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    Config::load(None, std::iter::empty(), &args, &PluginSections::new())
}

const ON: [&str; 4] = [
    "distillation.enabled=true",
    "distillation.teacher_model.model_path=/teacher",
    "distillation.distillation_loss.loss_mode=forward_kl_topk",
    "distillation.distillation_loss.topk=8",
];

/// verl's keys load; the actor engine gets the loss section, the teacher engine the
/// reference's settings with the teacher's weights and its own role.
#[test]
fn verls_keys_reach_the_engines() {
    let c = load(&ON).unwrap();
    assert_eq!(c.distillation.topk(), Some(8));
    let actor = c.engine_json(EngineRole::Actor);
    assert_eq!(actor["distillation_loss"]["loss_mode"], "forward_kl_topk");
    assert_eq!(actor["distillation_loss"]["topk"], 8);
    assert_eq!(actor["distillation_loss"]["use_policy_gradient"], true);
    let teacher = c.engine_json(EngineRole::Teacher);
    assert_eq!(
        (teacher["role"].as_str(), teacher["model"]["path"].as_str()),
        (Some("teacher"), Some("/teacher"))
    );
    assert_eq!(teacher.get("distillation_loss"), None);
    assert_eq!(
        c.engine_strategy(EngineRole::Teacher),
        c.engine_strategy(EngineRole::Ref)
    );
    // Off (verl's default): no loss section for the actor, no teacher.
    let off = load(&[]).unwrap();
    assert!(!off.teacher_enabled());
    assert_eq!(
        off.engine_json(EngineRole::Actor).get("distillation_loss"),
        None
    );
    // An estimator mode asks the teacher for no top-k.
    let k3 = load(&[
        "distillation.enabled=true",
        "distillation.distillation_loss.loss_mode=k3",
    ]);
    assert_eq!(k3.unwrap().distillation.topk(), None);
}

#[test]
fn unknown_keys_are_refused_and_teacher_server_keys_reported() {
    let err = load(&["distillation.distillation_loss.top_k=8"]).unwrap_err();
    assert!(
        err.to_string()
            .contains("distillation.distillation_loss.top_k"),
        "{err}"
    );
    let warned = |arg: &str| {
        let args: Vec<&str> = ON.iter().copied().chain([arg]).collect();
        let findings = audit(&load(&args).unwrap(), &AuditContext::default());
        assert!(
            findings.iter().all(|f| f.severity != Severity::Error),
            "{arg}: {findings:?}"
        );
        findings.iter().any(|f| f.key.starts_with("distillation."))
    };
    assert!(!warned(
        "distillation.distillation_loss.use_task_rewards=false"
    ));
    for arg in [
        "distillation.num_workers=4",
        "distillation.teacher_model.n_gpus_per_node=2",
        "distillation.teacher_model.inference.name=vllm",
    ] {
        assert!(warned(arg), "{arg}");
    }
}
