{{/*
The operator's RBAC rules, least privilege: kopf reads and patches ModelCompilations (finalizers,
progress annotations, status) and posts Events; it never creates or deletes them. It gets
(never lists or watches) the push Secrets compilations name in spec.output.pushSecretRef, only
when operator.pushSecrets is on. With injection.enabled it lists and watches pods (only those
labelled cuvil.dev/model are kept) to count status.serving, and patches their
cuvil.dev/injected annotation to move their sidecars to a promoted digest. Cluster-scoped discovery (CRDs, namespaces) is separate because a namespaced operator
still needs the CRD watch.
*/}}
{{- define "cuvil.operator.namespacedRules" -}}
- apiGroups: ["cuvil.dev"]
  resources: ["modelcompilations"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["cuvil.dev"]
  resources: ["modelcompilations/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.operator.pushSecrets }}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}
{{- if .Values.injection.enabled }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- if and .Values.operator.peering .Values.operator.watchNamespace }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}

{{- define "cuvil.operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if not .Values.operator.watchNamespace }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- if .Values.operator.peering }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
{{- end }}
